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
from typing import Any  # noqa: E402

import pytest  # noqa: E402

#: A CaiT small enough to run in milliseconds, with every feature of the real ones.
TINY_CAIT: dict[str, Any] = dict(
    img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=10, init_values=1e-5
)


@pytest.fixture
def tiny_cait_kwargs() -> dict:
    return dict(TINY_CAIT)


@pytest.fixture(scope="session")
def official(tmp_path_factory) -> Path:
    """The session's one real-size checkpoint in the official CaiT layout.

    timm's ``cait_xxs24_224`` with seeded random weights (every parameter, gammas of
    std 0.1), saved as the official training code does: ``{'model': {'module.' + k: v}}``.
    """
    from timm_layerscale.demo import write_official_checkpoint

    path = tmp_path_factory.mktemp("official") / "XXS24_224.pth"
    write_official_checkpoint(path, "cait_xxs24_224", seed=0)
    return path


@pytest.fixture
def few_inputs(monkeypatch):
    """Verification inside ``convert_checkpoint`` (and the commands) on 1 input instead of 8."""
    import dataclasses

    from timm_layerscale import converter
    from timm_layerscale.parity.tolerance import VerifyOptions

    real = converter.verify_state_dicts

    def one_input(*args, options=None, **kwargs):
        return real(*args, options=dataclasses.replace(options or VerifyOptions(), num_inputs=1), **kwargs)

    monkeypatch.setattr(converter, "verify_state_dicts", one_input)


def create_model(name: str, **kwargs: Any) -> Any:
    """``timm.create_model`` typed as ``Any``, for tests that reach into a model's submodules."""
    import timm

    return timm.create_model(name, **kwargs)


def parity_report(
    passed: bool, reference: str = "cait_xxs24_224", model: str = "cait_xxs24_224_ls", **fields: Any
) -> Any:
    """A :class:`~timm_layerscale.parity.compare.ParityReport` of one image: bit-exact, or off by 0.5."""
    from timm_layerscale.parity.compare import ParityReport

    values: dict[str, Any] = dict(
        reference=reference,
        model=model,
        family="cait",
        inputs="1 image",
        num_inputs=1,
        dtype="float32",
        device="cpu",
        attention="manual",
        max_abs_diff=0.0 if passed else 0.5,
        max_rel_diff=0.0 if passed else 0.1,
        cosine_min=1.0 if passed else 0.99,
        top1_agreement=1.0,
        top5_agreement=1.0,
        bit_exact=passed,
        atol=0.0,
        rtol=0.0,
        passed=passed,
    )
    values.update(fields)
    return ParityReport(**values)
