"""Each layout a family writes is what its consumer reads: for every registered variant, the file the rules write from
its ``ls`` state dict (tensors on the meta device) is checked against timm's model of that layout, strictly and without
a filter (``ls``, ``timm``), against the authors' key set, shapes and container (``official``, from
``tests/authors_models.py``), and against transformers' ``AutoModel.from_pretrained`` (``transformers``)."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch

import timm_layerscale  # noqa: F401
from authors_models import official
from timm_layerscale.conversion.rules import target_tensors as _target
from timm_layerscale.conversion.rules import to_layout
from timm_layerscale.errors import RemapError
from timm_layerscale.families import VARIANTS, Variant, get_variant, state_dict_shapes
from timm_layerscale.layer_scale import LayerScale


def _written(v: Variant, layout: str, num_classes: int | None = None) -> dict[str, tuple[int, ...]]:
    ls = {k: torch.empty(s, device="meta") for k, s in state_dict_shapes(v, num_classes).items()}
    out = _target(ls, v, v.family.layouts["ls"], v.family.layouts[layout])
    return {k: tuple(t.shape) for k, t in out.items()}


#: One variant of each family and key template in the default run (each takes a second or more to build on the meta
#: device); every other behind ``slow``.
QUICK = {"cait_xxs24_224_ls", "deit3_small_patch16_224", "vit5_small_patch16_224", "vit_small_patch16_dinov3_ls"}
QUICK |= {"vit_small_plus_patch16_dinov3_qkvb_ls", "vit_7b_patch16_dinov3_ls", "vit_small_patch14_reg4_dinov2"}
QUICK |= {"vit_giant_patch14_dinov2", "convnext_tiny_ls", "convnext_atto_ls", "beit_base_patch16_224_ls"}
QUICK |= {"resmlp_12_224_ls", "xcit_nano_12_p16_224_ls", "xcit_nano_12_p8_224_ls", "vit_intern300m_patch14_448"}
QUICK |= {"vit_pe_lang_large_patch14_448_ls", "vit_pe_lang_gigantic_patch14_448_ls"}
ALL = [pytest.param(v.name, marks=[pytest.mark.slow] * (v.name not in QUICK)) for v in VARIANTS]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.full
def test_every_written_layout_is_what_its_consumer_loads(name):
    v = get_variant(name)
    for layout in v.family.targets():
        record = v.family.layouts[layout]
        if record.library:
            continue  # transformers: below
        if layout == "official":
            authors = official(v)
            if authors is None:  # an architecture the authors did not release: refused in one line
                with pytest.raises(RemapError, match=r"conv_mlp|not part of"):
                    _written(v, layout)
                continue
            want, container = authors
            classes = 0 if not any(k.startswith("head.") for k in want) else None
            assert _written(v, layout, classes) == want, layout
            assert (record.wrapper, record.prefix) == container
            continue
        with torch.device("meta"):
            model = timm.create_model(v.name if record is v.family.layouts["ls"] else str(v.reference))
        assert _written(v, layout) == {k: tuple(t.shape) for k, t in model.state_dict().items()}, layout


@pytest.mark.parametrize(
    "name",
    [
        "vit_small_patch16_dinov3_ls",
        "vit_small_plus_patch16_dinov3_qkvb_ls",
        "vit_small_patch14_reg4_dinov2",
        "vit_intern300m_patch14_448",
        *(
            pytest.param(n, marks=pytest.mark.slow)
            for n in ("vit_base_patch16_dinov3_qkvb_ls", "vit_base_patch14_dinov2")
        ),
    ],
)
def test_a_written_transformers_file_loads_in_automodel_as_written(name, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModel

    v = get_variant(name)
    layout = v.family.layouts["transformers"]
    with torch.device("meta"):
        shapes = state_dict_shapes(v, 0)
    ls = {k: torch.randn(s) for k, s in shapes.items()}
    written = _target(ls, v, v.family.layouts["ls"], layout)
    layout.config(v, shapes).save_pretrained(tmp_path)  # type: ignore[misc]
    save_file({k: t.contiguous() for k, t in written.items()}, tmp_path / "model.safetensors")
    model, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert len(model.state_dict()) == len(written)


def _source(v: Variant, folder, dtype: torch.dtype = torch.float32):
    """A seeded file of the tiny variant ``v`` in the layout ``gamma`` names for a ``.pth``, in its container."""
    from helpers import gamma_file
    from timm_layerscale.conversion.rules import to_gamma
    from timm_layerscale.parity.inputs import seed_parameters_
    from timm_layerscale.parity.references import build_reference

    sd = to_gamma(seed_parameters_(build_reference(v, num_classes=0), seed=2).state_dict(), v.family)
    torch.save(gamma_file({k: t.to(dtype) for k, t in sd.items()}, v.family), path := folder / f"{v.name}.pth")
    return path


@pytest.mark.usefixtures("few_inputs")
@pytest.mark.full
def test_verify_checks_every_layout_convert_writes(tiny_variants, tmp_path):
    """``verify`` tells a written file's layout as detection does, and passes each conversion of every family."""
    from timm_layerscale.converter import convert_checkpoint, verify_checkpoint

    for v in tiny_variants:
        source = _source(v, tmp_path)
        for layout in dict.fromkeys(v.family.layouts[n].name for n in v.family.targets()):
            out = tmp_path / f"{v.name}.{layout}.pth"
            convert_checkpoint(source, out, to=layout, options=None)
            report = verify_checkpoint(source, out)
            assert report.passed and report.weights_equal, (v.name, layout, report.format_table())


@pytest.mark.usefixtures("few_inputs")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_reg4_class_token_merged_in_a_lower_precision_verifies(dtype, tiny_variants, tmp_path):
    """DINOv2 ``_reg4``: the class slot is added in the source's precision and rounded once, on both sides."""
    from timm_layerscale.converter import convert_checkpoint, verify_checkpoint

    source = _source(get_variant("tinytest_dinov2"), tmp_path)
    res = convert_checkpoint(source, out := tmp_path / "ls.safetensors", dtype=dtype)
    assert res.report is not None and res.report.passed and "merge_class_slot" in res.changed
    assert verify_checkpoint(source, out).passed


@pytest.mark.usefixtures("few_inputs")
def test_a_bf16_source_folds_to_fp32_once(tiny_variants, tmp_path):
    from timm_layerscale.converter import convert_checkpoint, verify_checkpoint

    source = _source(get_variant("tinytest_cait_layerscale"), tmp_path, torch.bfloat16)
    res = convert_checkpoint(source, out := tmp_path / "folded.safetensors", fold=True, dtype="fp32")
    assert res.report is not None and res.report.passed and res.report.weights_equal
    assert verify_checkpoint(source, out).passed


@pytest.mark.usefixtures("few_inputs")
@pytest.mark.full
def test_dinov2_to_transformers_at_another_size(tmp_path):
    """A DINOv2 fine-tuned at 224 (its position embedding for that grid) into transformers' layout: its config takes
    that ``image_size``, and transformers' model is checked at the file's own size."""
    from timm_layerscale.converter import convert_checkpoint

    model = seed_model("vit_small_patch14_reg4_dinov2", img_size=224)
    torch.save(model.state_dict(), source := tmp_path / "dinov2_224.pth")
    res = convert_checkpoint(source, tmp_path / "hf.safetensors", to="transformers")
    assert res.overrides == {"num_classes": 0, "img_size": 224} and res.report is not None and res.report.passed


def seed_model(name: str, **kwargs):
    from timm_layerscale.parity.inputs import seed_parameters_

    return seed_parameters_(timm.create_model(name, num_classes=0, **kwargs), seed=3)


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.reference not in (None, v.name)])
@pytest.mark.full
def test_every_variant_is_its_timm_twin_with_layerscale_modules(name):
    """The twin's class and input size, each gate a LayerScale module (``promote=True``, the variant's initial
    value), the twin's keys and shapes once the gates are raw again, and the twin's pretrained tags."""
    v = get_variant(name)
    if not timm.is_model(str(v.reference)):
        pytest.skip(f"this timm has no {v.reference}")
    with torch.device("meta"):
        ref: Any = timm.create_model(str(v.reference))
        ours: Any = timm.create_model(name)
    assert isinstance(ours, type(ref)) and ours.pretrained_cfg["input_size"] == ref.pretrained_cfg["input_size"]
    gates = [m for m in ours.modules() if isinstance(m, LayerScale)]
    assert len(gates) == sum(1 for k in ours.state_dict() if v.family.gate_of(k))
    assert all(g.promote and g.init_value == v.init_value for g in gates)
    as_timm = {k: tuple(t.shape) for k, t in to_layout(ours.state_dict(), v.family, "timm").items()}
    assert as_timm == {k: tuple(t.shape) for k, t in ref.state_dict().items()}
    tags = {n.split(".", 1)[1] for n in timm.list_pretrained(f"{v.reference}.*")}
    assert {n.split(".", 1)[1] for n in timm.list_pretrained(f"{name}.*")} == tags
