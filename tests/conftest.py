"""Test set-up: offline, seeded, small."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Never reach the network, and never touch the user's caches (nor leave this one behind).
_HOME = tempfile.mkdtemp(prefix="timm-layerscale-tests-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_HOME, "hf")
os.environ["TORCH_HOME"] = os.path.join(_HOME, "torch")
os.environ["TIMM_LAYERSCALE_CACHE"] = os.path.join(_HOME, "cache")  # the shape table
os.environ.setdefault("TIMM_LAYERSCALE_AUTOLOAD", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def tiny_cait_kwargs() -> dict:
    from helpers import TINY_CAIT

    return dict(TINY_CAIT)


@pytest.fixture
def fused_attn():
    """Run a test with timm's fused attention on, then off; restore the default."""
    from timm.layers import set_fused_attn, use_fused_attn

    initial = use_fused_attn()

    def _set(enable: bool) -> None:
        set_fused_attn(enable)
        assert use_fused_attn() == enable

    yield _set
    set_fused_attn(initial)


@pytest.fixture(scope="session")
def official(tmp_path_factory) -> Path:
    """The session's one real-size checkpoint in the official CaiT layout."""
    from timm_layerscale.demo import write_official_checkpoint

    path = tmp_path_factory.mktemp("official") / "XXS24_224.pth"
    write_official_checkpoint(path, "cait_xxs24_224", seed=0)
    return path


@pytest.fixture
def tiny_variants(monkeypatch) -> tuple:
    """The tiny registered variants of every family (``tests/tiny_models.py``) in the variant table."""
    import tiny_models
    from timm_layerscale import families

    monkeypatch.setattr(families, "VARIANTS", (*families.VARIANTS, *tiny_models.TINY))
    return tiny_models.TINY


@pytest.fixture
def few_inputs(monkeypatch):
    """Verification on one seeded image where more are asked for (the default is 8): the same code path, for
    tests that are not about the number of images."""
    from timm_layerscale.parity import verify

    seeded = verify.seeded_inputs
    monkeypatch.setattr(verify, "seeded_inputs", lambda n, *a, **k: seeded(min(n, 1), *a, **k))
