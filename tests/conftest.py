"""Test set-up: offline, seeded, small."""
from __future__ import annotations

import os
import tempfile

# Never reach the network, and never touch the user's caches.
_HOME = tempfile.mkdtemp(prefix="timm-layerscale-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_HOME, "hf")
os.environ["TORCH_HOME"] = os.path.join(_HOME, "torch")
os.environ.setdefault("TIMM_LAYERSCALE_AUTOLOAD", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


#: A CaiT small enough to run in milliseconds, with every feature of the real ones.
TINY_CAIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=10, init_values=1e-5)


@pytest.fixture
def tiny_cait_kwargs() -> dict:
    return dict(TINY_CAIT)


@pytest.fixture(scope="session")
def official(tmp_path_factory) -> Path:
    """The session's one real-size checkpoint in the official CaiT layout.

    timm's ``cait_xxs24_224`` with seeded random weights (every parameter, gammas of
    std 0.1), saved as the official training code does: ``{'model': {'module.' + k: v}}``.
    """
    from timm_layerscale.conversion import write_official_checkpoint

    path = tmp_path_factory.mktemp("official") / "XXS24_224.pth"
    write_official_checkpoint(path, "cait_xxs24_224", seed=0)
    return path
