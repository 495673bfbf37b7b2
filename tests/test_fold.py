"""LayerScale folding: modules and state dicts by one rule, close to the unfolded model, loading and exporting."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from torch import nn

from helpers import TINY_CAIT, TINY_VIT5, images, randomize, tiny_pair
from timm_layerscale import LayerScale, LayerScaleError, fold_layerscale, to_layerscale
from timm_layerscale.models import vit5
from timm_layerscale.models.cait_ls import CaitLS


def test_folded_layerscale_constructor():
    model = CaitLS(**TINY_CAIT, folded_layerscale=True)
    assert model.folded_layerscale
    blocks = [*model.blocks, *(model.blocks_token_only or ())]
    assert all(isinstance(b.ls1, nn.Identity) and isinstance(b.ls2, nn.Identity) for b in blocks)
    assert not any(k.endswith("gamma") for k in model.state_dict())
    assert not CaitLS(**TINY_CAIT).folded_layerscale


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", ["cait", "vit5", "deit3"])
def test_timms_reparameterize_model_folds_as_fold_layerscale(family):
    """timm's deployment convention (``reparameterize_model``, as ``onnx_export.py --reparam`` calls it) folds
    this package's blocks through their ``reparameterize()``; ``fold_layerscale`` folds those and timm's
    DeiT-III blocks by the same rule, to the same tensors."""
    from timm.utils import reparameterize_model

    if family == "cait":
        model = tiny_pair()[1]
    elif family == "vit5":
        model = randomize(vit5.Vit5(**TINY_VIT5)).eval()
    else:
        model = randomize(timm.create_model("deit3_small_patch16_224", img_size=32, depth=2, num_classes=10)).eval()
    x = images(2, 32)
    with torch.inference_mode():
        expected = model(x)
    folded = fold_layerscale(copy.deepcopy(model))
    assert not any(isinstance(m, LayerScale) or hasattr(m, "gamma") for m in folded.modules())
    with torch.inference_mode():
        assert _max_diff(folded(x), expected) <= 1e-5
    if family != "deit3":
        reparameterized = reparameterize_model(model)
        assert reparameterized.folded_layerscale and not model.folded_layerscale  # a copy, unless inplace
        assert reparameterized.state_dict().keys() == folded.state_dict().keys()
        assert all(torch.equal(v, folded.state_dict()[k]) for k, v in reparameterized.state_dict().items())


def test_fold_timm_layerscale_blocks():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, init_values=0.1, num_classes=10)
    randomize(model).eval()
    x = images(2, 32)
    with torch.inference_mode():
        expected = model(x)
    fold_layerscale(model)
    assert isinstance(model.get_submodule("blocks.0.ls1"), nn.Identity)
    with torch.inference_mode():
        assert _max_diff(model(x), expected) <= 1e-5


def test_fold_without_foldable_linear_fails_and_leaves_model_alone():
    _, ours = tiny_pair()
    ours.get_submodule("blocks.1.mlp").fc2 = nn.Identity()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"blocks\.1: cannot fold ls2 .* at mlp\.fc2, found Identity"):
        fold_layerscale(ours)
    assert isinstance(ours.get_submodule("blocks.0.ls1"), LayerScale)
    after = ours.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    _, ours = tiny_pair()
    ours.get_submodule("blocks.0.attn").proj = nn.Linear(32, 16)
    with pytest.raises(ValueError, match=r"at attn\.proj, found Linear of 16 outputs"):
        fold_layerscale(ours)


def test_fold_without_layerscale_is_a_no_op():
    model = CaitLS(**dict(TINY_CAIT, init_values=None))
    before = copy.deepcopy(model.state_dict())
    fold_layerscale(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fold_vit5_close_and_loads():
    model = randomize(vit5.Vit5(**TINY_VIT5)).eval()
    x = images(2, 32)
    with torch.inference_mode():
        expected = model(x)
    fold_layerscale(model)
    assert model.folded_layerscale
    with torch.inference_mode():
        assert _max_diff(model(x), expected) <= 1e-5
    vit5.Vit5(**TINY_VIT5, folded_layerscale=True).load_state_dict(model.state_dict(), strict=True)


#: What the legacy exporter says of itself, and of the size check in timm's PatchEmbed it traces.
_LEGACY_EXPORTER_WARNINGS = [
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Converting a tensor to a Python:torch.jit.TracerWarning"),
]


def _tiny_cait_folded() -> nn.Module:
    return fold_layerscale(tiny_pair()[1])


def _tiny_vit5(folded: bool) -> nn.Module:
    model = randomize(vit5.Vit5(**TINY_VIT5)).eval()
    return fold_layerscale(model) if folded else model


@pytest.mark.parametrize(
    "build, dynamo",
    [
        (_tiny_cait_folded, True),
        pytest.param(_tiny_cait_folded, False, marks=_LEGACY_EXPORTER_WARNINGS),
        (lambda: _tiny_vit5(folded=False), True),
        (lambda: _tiny_vit5(folded=True), True),
    ],
    ids=[
        "cait_folded-dynamo_exporter",
        "cait_folded-torchscript_exporter",
        "vit5-dynamo_exporter",
        "vit5_folded-dynamo_exporter",
    ],
)
@pytest.mark.full
def test_onnx_export_runs_in_onnxruntime_at_any_batch_size(tmp_path, build, dynamo):
    """The exported graph, with a dynamic batch, gives the model's outputs in onnxruntime at other batch sizes.
    ViT-5 takes the dynamo exporter only: the TorchScript one has no ONNX operator for torch's rms_norm."""
    import onnx
    import onnxruntime

    model = build()
    path = tmp_path / "model.onnx"
    batch = (
        {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=16)},)}
        if dynamo
        else {"dynamic_axes": {"images": {0: "batch"}}}
    )
    torch.onnx.export(
        model, (images(2, 32),), str(path), dynamo=dynamo, input_names=["images"], output_names=["logits"], **batch
    )
    onnx.checker.check_model(onnx.load(str(path)))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        x = images(n, 32)
        (got,) = session.run(None, {"images": x.numpy()})
        with torch.inference_mode():
            assert _max_diff(torch.from_numpy(got), model(x)) <= 1e-5, n


def test_fold_state_dict_equals_module_fold(tmp_path):
    from timm_layerscale import fold_state_dict

    _, ours = tiny_pair()
    folded_sd = fold_state_dict(ours.state_dict())
    module_sd = fold_layerscale(copy.deepcopy(ours)).state_dict()
    assert folded_sd.keys() == module_sd.keys()
    assert all(torch.equal(folded_sd[k], module_sd[k]) for k in module_sd), "the same rule, the same floats"
    assert fold_state_dict(folded_sd).keys() == folded_sd.keys(), "nothing left to fold"
    bad = dict(ours.state_dict())
    del bad["blocks.0.attn.proj.weight"]
    with pytest.raises(ValueError, match=r"blocks\.0\.ls1\.gamma.*blocks\.0\.attn\.proj") as refused:
        fold_state_dict(bad)
    assert isinstance(refused.value, LayerScaleError), "one line on the command line, not an internal error"


@pytest.mark.compat
@pytest.mark.parametrize("layout", ["official", "ls"])
@pytest.mark.full
def test_folded_model_loads_pretrained_weights(tmp_path, layout):
    from safetensors.torch import save_file

    from timm_layerscale import fold_state_dict
    from timm_layerscale.parity.tolerance import folded_bound

    ref = randomize(timm.create_model("cait_xxs24_224")).eval()
    if layout == "official":
        path = tmp_path / "XXS24_224.pth"
        torch.save({"model": {"module." + k: v for k, v in ref.state_dict().items()}}, path)
    else:
        path = tmp_path / "ls.safetensors"
        save_file(to_layerscale(ref.state_dict(), "cait"), path)
    folded = timm.create_model(
        "cait_xxs24_224_ls", pretrained=True, folded_layerscale=True, pretrained_cfg_overlay=dict(file=str(path))
    ).eval()
    expected = fold_state_dict(to_layerscale(ref.state_dict(), "cait"))
    assert folded.state_dict().keys() == expected.keys()
    assert all(torch.equal(folded.state_dict()[k], v) for k, v in expected.items())
    x = images(2, 224)
    atol = rtol = folded_bound(26, 192, torch.float32)  # cait_xxs24_224: 24 + 2 blocks
    with torch.inference_mode():
        a, b = ref(x), folded(x)
    assert ((a - b).abs() <= atol + rtol * a.abs()).all()


def test_vit5_filter_folds_with_the_same_rule():
    from timm_layerscale import fold_state_dict

    model = randomize(vit5.Vit5(**TINY_VIT5)).eval()
    target = vit5.Vit5(**TINY_VIT5, folded_layerscale=True)
    filtered = vit5.checkpoint_filter_fn(model.state_dict(), target)
    expected = fold_state_dict(model.state_dict())
    assert filtered.keys() == expected.keys()
    assert all(torch.equal(filtered[k], expected[k]) for k in expected)


@pytest.mark.parametrize("model", [None, "cait_xxs24_224_ls"])
def test_a_folded_checkpoint_is_named_as_folded(model):
    from timm_layerscale import fold_state_dict
    from timm_layerscale.conversion.detect import detect
    from timm_layerscale.errors import ArchitectureError

    folded = fold_state_dict(to_layerscale(timm.create_model("cait_xxs24_224").state_dict(), "cait"))
    with pytest.raises(ArchitectureError, match=r"weights of cait_xxs24_224_ls but no LayerScale gates: .* folded"):
        detect(folded, model)


def test_a_convolutional_blocks_one_gate_folds_into_its_1x1_convolution() -> None:
    """A block's one gate ``ls`` (ConvNeXt's, outside ``blocks.N``) folds into an ``mlp.fc2`` that is a 1x1
    convolution, in a module and in a state dict alike; a norm's ``grn.gamma`` is no gate."""
    from timm_layerscale.conversion.fold import fold_state_dict
    from timm_layerscale.families import get_family
    from timm_layerscale.layer_scale import fold_block, fold_plan

    block: Any = nn.Module()
    block.mlp, block.ls = nn.Module(), LayerScale(4, 0.5)
    block.mlp.fc2 = nn.Conv2d(8, 4, 1)
    with torch.no_grad():
        block.ls.gamma.uniform_(0.1, 2.0)
        x = torch.randn(2, 8, 3, 5, generator=torch.Generator().manual_seed(0))
        want = block.ls(block.mlp.fc2(x).permute(0, 2, 3, 1))
        sd = {f"stages.1.blocks.2.{k}": v.clone() for k, v in block.state_dict().items()}
        fold_block(block, fold_plan(block, get_family("convnext").gates))
        torch.testing.assert_close(block.mlp.fc2(x).permute(0, 2, 3, 1), want)
    assert isinstance(block.ls, nn.Identity)
    folded = fold_state_dict(sd)
    assert "stages.1.blocks.2.ls.gamma" not in folded
    assert torch.equal(folded["stages.1.blocks.2.mlp.fc2.weight"], block.mlp.fc2.weight)
    convnext = get_family("convnext")
    assert convnext.gate_of("stages.1.blocks.2.ls.gamma") and not convnext.gate_of("stages.0.0.grn.gamma")
