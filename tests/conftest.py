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


#: The compatibility subset: what ``make test-compat`` runs in every timm x torch environment
#: of its matrix (``pytest -m compat``). File name -> test functions (every parametrization,
#: or one, named with its id in brackets), or ``"*"`` for the whole file. It covers the
#: registry and ``create_model`` by name, pretrained loading from all three layouts, exact
#: parity with timm's ``cait_*`` and ``deit3_*`` (outputs, bf16, gradients, fused attention
#: on and off), the conversion round trip, the start-up hook and timm's training loop, at the
#: smallest sizes that show each.
COMPAT: dict[str, tuple[str, ...] | str] = {
    "test_cait_ls.py": (
        "test_ten_names_registered_in_their_own_module",
        "test_registry_meta_build_and_pretrained_cfg",
        "test_forward_bit_exact",
        "test_pretrained_from_any_layout",
        "test_pretrained_at_another_img_size",
        "test_model_contract",
        "test_features_only_and_prune",
    ),
    "test_perf_paths.py": ("test_train_mode_gradients_bit_exact", "test_fused_model_loads_pretrained_weights"),
    "test_exact_attention.py": (
        "test_buffered_attention_makes_timms_kernel_calls",
        "test_frozen_mixing_weights_take_the_reference_formulation",
        "test_model_makes_timms_kernel_calls",
        "test_cait_xxs24_bit_exact_eval_and_train",
        "test_exact_parity_under_other_kernel_dispatch[aten-default]",
    ),
    "test_deit3.py": (
        "test_converted_file_matches_timm_loader_bit_for_bit",
        "test_round_trip_keeps_tensors",
        "test_every_deit3_layout_round_trips_on_meta",
    ),
    "test_vit5.py": (
        "test_registered_with_timm",
        "test_package_matches_reference_module_within_tolerance",
        "test_converted_file_loads_with_file_overlay",
    ),
    "test_conversion.py": (
        "test_done_when_loads_with_timm_create_model",
        "test_source_layouts_convert_to_the_same_tensors",
        "test_to_gamma_round_trip_gives_back_the_official_file",
    ),
    "test_convert_families.py": ("test_deit3_official_file_converts_bit_exact",),
    "test_io.py": ("test_load_pth_zip_and_legacy", "test_training_checkpoint_with_argparse_namespace_loads"),
    "test_autoload.py": "*",
    "test_train_loop.py": (
        "test_optimizer_factory_exempts_every_gamma_from_weight_decay",
        "test_model_ema_keeps_the_tag_and_tracks_the_model",
        "test_grad_checkpointing_gives_the_eager_gradients_exactly",
        "test_compiled_train_step_gives_the_eager_gradients",
        "test_a_few_bf16_autocast_steps_lower_the_loss",
        "test_train_py_checkpoint_holds_what_train_py_writes",
        "test_train_py_checkpoint_converts_to_gamma_and_loads_into_timm_cait[ema]",
    ),
}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests named in :data:`COMPAT`; with ``-m compat``, fail on a name that matches none."""
    found: set[tuple[str, str]] = set()
    collected: set[str] = set()
    for item in items:
        file = item.path.name
        collected.add(file)
        wanted = COMPAT.get(file, ())
        for name in (getattr(item, "originalname", item.name), item.name):
            if wanted == "*" or name in wanted:
                item.add_marker(pytest.mark.compat)
                found.add((file, name))
    if "compat" in (config.getoption("markexpr") or ""):
        missing = [
            f"{file}::{name}"
            for file, names in COMPAT.items()
            if file in collected and names != "*"
            for name in names
            if (file, name) not in found
        ]
        if missing:
            raise pytest.UsageError(f"tests/conftest.py COMPAT names tests that do not exist: {', '.join(missing)}")


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
