"""Library-level conversion, verification and architecture detection."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
from safetensors import safe_open

import timm_layerscale  # noqa: F401  (registers the models)
from helpers import detected, images
from timm_layerscale import converter as conversion
from timm_layerscale._version import __version__
from timm_layerscale.conversion.rules import to_layerscale
from timm_layerscale.converter import convert_checkpoint, verify_checkpoint
from timm_layerscale.errors import ArchitectureError, CheckpointError, LayerScaleError, RemapError
from timm_layerscale.parity.inputs import seeded_inputs
from timm_layerscale.parity.tolerance import VerifyOptions

MODEL = "cait_xxs24_224_ls"
REFERENCE = "cait_xxs24_224"


@pytest.fixture(scope="module")
def official_sd(official) -> dict[str, torch.Tensor]:
    """The official file's inner state dict, ``module.`` prefixes included."""
    return torch.load(official, map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def gamma_sd(official_sd) -> dict[str, torch.Tensor]:
    """timm's layout: official keys without the DDP prefix."""
    return {k.removeprefix("module."): v for k, v in official_sd.items()}


@pytest.fixture(scope="module")
def ls_sd(gamma_sd) -> dict[str, torch.Tensor]:
    return to_layerscale(gamma_sd, "cait")


@pytest.fixture(scope="module")
def reference(gamma_sd) -> torch.nn.Module:
    """timm's CaiT holding the official weights, loaded without this package's code."""
    ref = timm.create_model(REFERENCE)
    ref.load_state_dict(gamma_sd, strict=True)
    return ref.eval()


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory) -> conversion.ConversionResult:
    """The official file converted with every default, full verification included."""
    out = tmp_path_factory.mktemp("converted") / f"{MODEL}.safetensors"
    return convert_checkpoint(official, out)


def load_output(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(got, expected, dtype: torch.dtype | None = None) -> None:
    assert set(got) == set(expected)
    for k, v in expected.items():
        want = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert got[k].dtype == want.dtype, k
        assert torch.equal(got[k], want), k


def no_leftovers(folder: Path, *keep: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(keep)


def test_default_conversion_is_verified_bit_exact(converted, official, ls_sd):
    res = converted
    assert res.variant.name == MODEL and res.overrides == {}
    assert (res.source_layout, res.target_layout) == ("official", "ls")
    rep = res.report
    assert rep is not None and rep.passed and rep.bit_exact
    assert rep.max_abs_diff == 0 and rep.max_rel_diff == 0 and rep.cosine_min == pytest.approx(1.0)
    assert rep.top1_agreement == 1 and rep.top5_agreement == 1
    assert (rep.reference, rep.model, rep.num_inputs) == (REFERENCE, MODEL, 8)
    assert (rep.dtype, rep.device, rep.atol, rep.rtol) == ("float32", "cpu", 0, 0)
    assert not rep.attention.startswith("reference:"), "both models must take the same attention path"
    assert rep.versions["timm"] == timm.__version__ and rep.versions["torch"] == torch.__version__
    table = rep.format_table()
    for row in ("max abs diff", "max rel diff", "cosine", "top-1", "top-5", "attention", "versions"):
        assert row in table
    assert any(line.split() == ["bit-exact", "yes"] for line in table.splitlines())
    json.dumps(rep.to_dict())

    assert_same_tensors(load_output(res.output), ls_sd)
    no_leftovers(res.output.parent, res.output.name)


def test_safetensors_metadata(converted, official):
    with safe_open(str(converted.output), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert meta["source_file"] == official.name
    assert meta["source_sha256"] == hashlib.sha256(official.read_bytes()).hexdigest() == converted.source_sha256
    assert meta["source_layout"] == "official"
    assert meta["architecture"] == MODEL
    assert __version__ in meta["converter"]
    assert meta["parity"] == "bit-exact" and meta["parity_weights"] == "476 tensors equal to the source's"
    assert (meta["parity_atol"], meta["parity_rtol"], meta["parity_max_abs_diff"]) == ("0", "0", "0")
    assert meta["parity_reference"] == REFERENCE and meta["parity_dtype"] == "float32"


@pytest.mark.full
def test_a_model_computing_on_the_written_file_gives_timms_outputs_for_one_image(ls_sd, reference, tmp_path):
    """``load_state_dict(load_file(path), assign=True)``, as transformers loads, computes on the file's
    memory, where a weight's alignment decides how a one-row GEMM is summed: at every header length
    the written weights must give the reference's logits for one image."""
    from safetensors.torch import load_file

    from timm_layerscale.files.save import save_safetensors

    x = images(1, 224)
    with torch.inference_mode():
        expected = reference(x)
        for pad in range(0, 64, 8):
            path = tmp_path / f"pad{pad}.safetensors"
            save_safetensors(path, ls_sd, {"pad": "x" * pad})
            with torch.device("meta"):
                model = timm.create_model(MODEL)
            model.load_state_dict(load_file(path), assign=True)
            assert torch.equal(model.eval()(x), expected), pad


def test_checkpoint_path_takes_the_models_own_layout(converted, official, reference):
    """``checkpoint_path=`` (timm's ``--initial-checkpoint``) loads without the pretrained filter, as for timm's models."""
    model = timm.create_model(MODEL, checkpoint_path=str(converted.output)).eval()
    x = seeded_inputs(1, 224, seed=5)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .blocks\.0\.gamma_1"):
        timm.create_model(MODEL, checkpoint_path=str(official))


def _layouts(gamma_sd, ls_sd):
    return {
        "timm-gamma.safetensors": lambda: gamma_sd,  # timm's Hub copies: plain, no prefix
        "ls.pth": lambda: ls_sd,
        "compiled.pth": lambda: {"state_dict": {"_orig_mod." + k: v for k, v in gamma_sd.items()}},
        "ddp-compiled.pth": lambda: {"model": {"module._orig_mod." + k: v for k, v in gamma_sd.items()}, "epoch": 3},
        # PyTorch Lightning: the LightningModule's attribute names every key; the other entries
        # are those a Trainer's ModelCheckpoint writes (Lightning 2.6)
        "lightning.ckpt": lambda: {
            "state_dict": {"model." + k: v for k, v in gamma_sd.items()},
            "epoch": 3,
            "global_step": 2,
            "pytorch-lightning_version": "2.6.6",
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": "/ck"}},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 1e-4}]}],
            "lr_schedulers": [{"step_size": 1, "last_epoch": 2}],
            "hparams_name": "kwargs",
            "hyper_parameters": {"lr": 1e-4, "name": "cait_xxs24_224"},
        },
        # DeepSpeed's mp_rank_00_model_states.pt (ZeRO stages 0-2, as DeepSpeed 0.19 writes it): the
        # model's own state dict under 'module'
        "deepspeed.pt": lambda: {
            "module": dict(gamma_sd),
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [{k: v.shape for k, v in gamma_sd.items()}],
            "frozen_param_shapes": None,
            "shared_params": {},
            "lr_scheduler": None,
            "global_steps": 2,
            "dp_world_size": 2,
            "checkpoint_parallel_dimensions": {},
            "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 2}},
            "ds_version": "0.19.8",
        },
    }


@pytest.mark.compat
@pytest.mark.parametrize(
    "name", ["timm-gamma.safetensors", "ls.pth", "compiled.pth", "ddp-compiled.pth", "lightning.ckpt", "deepspeed.pt"]
)
def test_source_layouts_convert_to_the_same_tensors(name, gamma_sd, ls_sd, tmp_path):
    src = tmp_path / name
    obj = _layouts(gamma_sd, ls_sd)[name]()
    if src.suffix == ".safetensors":
        safetensors.torch.save_file(obj, str(src))
    else:
        torch.save(obj, src)
    out = tmp_path / "out" / "x.safetensors"
    out.parent.mkdir()
    res = convert_checkpoint(src, out, verify=False)
    assert res.variant.name == MODEL and res.report is None
    # the DDP wrapper and prefix of the official training code's files tell its layout apart from timm's
    assert res.source_layout == {"ls.pth": "ls", "ddp-compiled.pth": "official"}.get(name, "timm")
    assert_same_tensors(load_output(out), ls_sd)
    no_leftovers(out.parent, "x.safetensors")


def test_model_ema_is_taken_only_when_asked(gamma_sd, ls_sd, tmp_path):
    other = {k: v + 1 if v.is_floating_point() else v for k, v in gamma_sd.items()}
    src = tmp_path / "train.pth"
    torch.save({"model": other, "model_ema": gamma_sd, "optimizer": {}, "epoch": 400}, src)
    res = convert_checkpoint(src, tmp_path / "ema.safetensors", verify=False, ema=True)
    assert_same_tensors(load_output(res.output), ls_sd)
    res = convert_checkpoint(src, tmp_path / "plain.safetensors", verify=False)
    assert_same_tensors(load_output(res.output), to_layerscale(other, "cait"))

    only_ema = tmp_path / "only-ema.pth"
    torch.save({"model_ema": gamma_sd}, only_ema)
    with pytest.raises(LayerScaleError, match="pass ema=True"):
        convert_checkpoint(only_ema, tmp_path / "x.safetensors", verify=False)
    no_ema = tmp_path / "no-ema.pth"
    torch.save({"model": gamma_sd}, no_ema)
    with pytest.raises(LayerScaleError, match="no 'model_ema' state dict"):
        convert_checkpoint(no_ema, tmp_path / "y.safetensors", verify=False, ema=True)
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y.safetensors").exists()


@pytest.mark.compat
@pytest.mark.full
def test_to_gamma_round_trip_gives_back_the_official_file(official, official_sd, converted, tmp_path, few_inputs):
    back = tmp_path / "gamma.pth"
    res = convert_checkpoint(converted.output, back, to="gamma")
    assert res.report is not None and res.report.bit_exact
    assert (res.source_layout, res.target_layout) == ("ls", "official")
    assert res.container == "{'model': {'module.' + key: tensor}}" and "pass --to official" in res.note
    # The official training code's file: the 'model' wrapper and the DDP prefix, key for key, bit for bit.
    obj = load_output(back)
    assert list(obj) == ["model"]
    assert_same_tensors(obj["model"], official_sd)

    # plain=True (deprecated) and a safetensors file write timm's layout: the bare state dict of timm's Hub copies.
    bare = convert_checkpoint(converted.output, tmp_path / "bare.pth", to="gamma", plain=True, verify=False)
    flat = convert_checkpoint(converted.output, tmp_path / "flat.safetensors", to="gamma", verify=False)
    assert bare.container == flat.container == "state dict" and bare.target_layout == flat.target_layout == "timm"
    for path in (bare.output, flat.output):
        assert_same_tensors({"module." + k: v for k, v in load_output(path).items()}, official_sd)

    # And the official file converts back to the same ls file.
    again = tmp_path / "again.safetensors"
    convert_checkpoint(back, again, verify=False)
    assert_same_tensors(load_output(again), load_output(converted.output))


@pytest.mark.full
def test_a_gamma_file_to_gamma_is_resaved_in_timms_layout(official, official_sd, tmp_path):
    # The official .pth re-saved as the bare safetensors file timm's cait_* loads, verified.
    res = convert_checkpoint(official, tmp_path / "timm.safetensors", to="gamma")
    assert (
        res.report is not None
        and res.report.bit_exact
        and res.container == "state dict"
        and (res.source_layout, res.target_layout) == ("official", "timm")
    )
    assert_same_tensors({"module." + k: v for k, v in load_output(res.output).items()}, official_sd)
    res.output.unlink()
    with pytest.raises(LayerScaleError, match="plain applies to to='gamma' only"):
        convert_checkpoint(official, tmp_path / "x.pth", plain=True, verify=False)
    no_leftovers(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_keep_their_dtype(dtype, gamma_sd, ls_sd, tmp_path):
    src = tmp_path / "half.pth"
    torch.save({"model": {"module." + k: v.to(dtype) for k, v in gamma_sd.items()}}, src)
    for fmt in ("safetensors", "pth"):
        res = convert_checkpoint(src, tmp_path / f"out.{fmt}", verify=False)
        assert_same_tensors(load_output(res.output), ls_sd, dtype=dtype)


def test_dtype_bf16_casts_and_verifies_in_bf16(official, ls_sd, tmp_path, few_inputs):
    res = convert_checkpoint(official, tmp_path / "bf16.safetensors", dtype="bf16")
    assert_same_tensors(load_output(res.output), ls_sd, dtype=torch.bfloat16)
    rep = res.report
    assert rep is not None
    assert rep.dtype == "bfloat16" and rep.passed and rep.bit_exact and rep.num_inputs == 1


def test_verified_models_compute_on_fresh_copies_built_on_meta_unless_they_compute_buffers() -> None:
    """Verification's models are built on the meta device and take fresh copies of the weights; a
    model with a computed buffer that its state dict does not hold is built for real, so the buffer
    is computed."""
    from timm_layerscale.parity.references import build_loaded

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.built_on = self.fc.weight.device.type

    class Computed(Plain):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    sd = {"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4)}
    plain = build_loaded(Plain, sd, "plain")
    computed = build_loaded(Computed, sd, "computed")
    assert plain.built_on == "meta" and computed.built_on == "cpu"
    assert torch.equal(computed.get_buffer("table"), torch.arange(4.0))
    for model in (plain, computed):
        assert not model.training
        for key, tensor in sd.items():
            loaded = model.state_dict()[key]
            assert torch.equal(loaded, tensor) and loaded.data_ptr() != tensor.data_ptr()
            assert loaded.data_ptr() % 64 == 0  # a fresh allocation, whatever the source's alignment


@pytest.mark.full
def test_verify_takes_state_dicts_and_image_files(gamma_sd, ls_sd, converted, official, tmp_path):
    from PIL import Image

    rep = verify_checkpoint(gamma_sd, ls_sd, options=VerifyOptions(num_inputs=1))
    assert rep.passed and rep.bit_exact and rep.model == MODEL and rep.num_inputs == 1

    img = tmp_path / "cat.png"
    Image.fromarray((torch.arange(300 * 200 * 3) % 251).to(torch.uint8).reshape(200, 300, 3).numpy()).save(img)
    rep = verify_checkpoint(official, converted.output, options=VerifyOptions(images=(str(img),), num_inputs=1))
    assert rep.passed and rep.bit_exact and rep.num_inputs == 2
    assert rep.inputs == "1 seeded N(0,1) images (seed 0) + 1 image file(s) at 224x224"
    only = verify_checkpoint(official, converted.output, options=VerifyOptions(images=(str(img),) * 2, num_inputs=0))
    assert only.passed and only.bit_exact and only.num_inputs == 2 and only.inputs == "2 image file(s) at 224x224"
    with pytest.raises(LayerScaleError, match="num_inputs=0 leaves no inputs; pass image files too"):
        VerifyOptions(num_inputs=0)

    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    with pytest.raises(CheckpointError, match="cannot read image"):
        verify_checkpoint(official, converted.output, options=VerifyOptions(images=(str(bad),), num_inputs=1))


def test_verify_on_cuda_without_a_gpu_is_a_user_error(gamma_sd, ls_sd, official, converted, monkeypatch, capsys):
    from helpers import assert_one_line_error, cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CheckpointError, match=r"no CUDA device is available here; pass device='cpu'$"):
        verify_checkpoint(gamma_sd, ls_sd, options=VerifyOptions(device="cuda"))
    code, out, err = cli(capsys, "verify", official, converted.output, "--device", "cuda:1")
    assert_one_line_error(code, out, err, "device 'cuda:1': no CUDA device is available here; pass --device cpu")


def test_verify_names_converted_weights_of_another_model(official, ls_sd, tmp_path):
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file({k: v for k, v in ls_sd.items() if k != "blocks.23.ls1.gamma"}, other)
    expect = f"{other} is not a conversion of {official}: checkpoint does not fit {MODEL}: 1 missing (blocks.23"
    with pytest.raises(RemapError, match=re.escape(expect)) as e:
        verify_checkpoint(official, other, options=VerifyOptions(num_inputs=1))
    assert str(e.value).endswith("; pass the weights converted from it")
    with pytest.raises(RemapError, match=r"^the converted state dict is not a conversion of the source: "):
        verify_checkpoint(torch.load(official, weights_only=True), {**ls_sd, "reg_token": ls_sd["cls_token"]})


@pytest.mark.full
def test_a_backbone_saved_without_its_head_converts_as_one(gamma_sd, tmp_path, few_inputs):
    """A model trained or kept as a feature extractor (timm's ``num_classes=0``) has no ``head``."""
    sd = {k: v for k, v in gamma_sd.items() if not k.startswith("head.")}
    src = tmp_path / "backbone.pth"
    torch.save({"model": sd}, src)
    res = convert_checkpoint(src, tmp_path / "backbone.safetensors")
    assert res.overrides == {"num_classes": 0} and res.metadata["num_classes"] == "0"
    assert res.report is not None and res.report.passed and res.report.bit_exact
    # its outputs are 192 features: no class agreement is claimed over them
    assert res.report.top1_agreement is None and res.report.top5_agreement is None
    assert [" ".join(line.split()) for line in res.report.format_table().splitlines() if "agreement" in line] == [
        "top-1 agreement - (no classifier)",
        "top-5 agreement - (no classifier)",
    ]
    out = load_output(res.output)
    assert not any(k.startswith("head.") for k in out) and len(out) == len(sd)
    model = timm.create_model(MODEL, pretrained=True, num_classes=0, pretrained_cfg_overlay=dict(file=str(res.output)))
    assert model.eval()(images(2, 224)).shape == (2, 192)
    back = convert_checkpoint(res.output, tmp_path / "back.pth", to="gamma", plain=True, verify=False)
    assert_same_tensors(torch.load(back.output, weights_only=True), sd)


@pytest.mark.parametrize("name", ["cait_xxs24_224_ls", "deit3_small_patch16_224", "vit5_small_patch16_224"])
@pytest.mark.parametrize("args", [{"num_classes": 0}, {"img_size": 320}, {"num_classes": 10, "img_size": 256}])
def test_each_family_is_detected_without_its_head_or_at_another_resolution(name, args):
    """A backbone without its head; a fine-tune at a resolution no variant is registered at."""
    from timm_layerscale.conversion.detect import state_dict_shapes
    from timm_layerscale.conversion.rules import to_gamma
    from timm_layerscale.families import get_variant

    variant = get_variant(name)
    shapes = state_dict_shapes(variant, **args)
    sd = to_gamma({k: torch.empty(s, device="meta") for k, s in shapes.items()}, variant.family)
    found = detected(sd)
    assert found.variant == variant and found.overrides == args


@pytest.mark.full
def test_a_checkpoint_fine_tuned_at_another_resolution_converts(gamma_sd, tmp_path, few_inputs):
    """timm's cait_xxs24_224 fine-tuned at 256 x 256 (``img_size=256``): its position embedding has a
    16 x 16 grid, which no CaiT variant is registered with."""
    sd = dict(gamma_sd, pos_embed=torch.randn(1, 16 * 16, 192, generator=torch.Generator().manual_seed(3)))
    src = tmp_path / "ft256.pth"
    torch.save({"model": sd}, src)
    res = convert_checkpoint(src, tmp_path / "ft256.safetensors")
    assert res.variant.name == MODEL and res.overrides == {"img_size": 256} and res.metadata["img_size"] == "256"
    assert res.report is not None and res.report.bit_exact and res.report.inputs.endswith("at 256x256")
    file = dict(file=str(res.output))
    model = timm.create_model(MODEL, pretrained=True, img_size=256, pretrained_cfg_overlay=file).eval()
    reference = timm.create_model("cait_xxs24_224", img_size=256).eval()
    reference.load_state_dict(sd)
    x = images(2, 256)
    assert torch.equal(model(x), reference(x))
    assert verify_checkpoint(src, res.output).bit_exact


def test_named_model_mismatch_lists_missing_unexpected_and_misshaped_keys(gamma_sd):
    sd = dict(gamma_sd)
    dropped = [f"blocks.{i}.norm1.bias" for i in range(7)]
    for k in dropped:
        del sd[k]
    sd["blocks.24.norm1.weight"] = torch.ones(192)
    sd["blocks.3.mlp.fc1.bias"] = torch.zeros(700)
    with pytest.raises(RemapError) as info:
        detected(sd, MODEL)
    msg = str(info.value)
    assert "\n" not in msg and MODEL in msg
    assert "7 missing (blocks.0.norm1.bias [192], blocks.1.norm1.bias [192]" in msg
    assert "blocks.5.norm1.bias" not in msg and ", ...)" in msg  # first few, then a count
    assert "1 unexpected (blocks.24.norm1.weight [192])" in msg
    assert "1 mis-shaped (blocks.3.mlp.fc1.bias [700] != [768])" in msg

    with pytest.raises(
        RemapError, match=r"not part of a CaiT \(timm layout\) checkpoint: blocks\.0\.attn\.rope\.freqs"
    ):
        detected(dict(gamma_sd, **{"blocks.0.attn.rope.freqs": torch.ones(4)}), MODEL)
    with pytest.raises(ArchitectureError, match="unknown model 'cait_xxs24_224_lss'; did you mean cait_xxs24_224_ls"):
        detected(gamma_sd, "cait_xxs24_224_lss")
