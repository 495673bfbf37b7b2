"""LayerScale CaiT: registry, timm model contract, and bit-exact parity with timm's ``cait_*``."""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import set_fused_attn

import timm_layerscale  # noqa: F401  (registers the models)
from helpers import DEVICES, TINY_CAIT, assert_traces_and_scripts, create_model
from kernel_trace import compiled_graph, compiled_reference, reduction_trace
from timm_layerscale import to_gamma, to_layerscale
from timm_layerscale.models.cait_ls import VARIANTS, CaitLS
from timm_layerscale.parity.inputs import seed_parameters_

NAMES = sorted(VARIANTS)
IMG = {name: int(name.split("_")[2]) for name in NAMES}


def _pair(ref_name: str, seed: int = 0, **kwargs):
    """timm's reference with seeded weights in every parameter, and our model loaded from it."""
    ref = create_model(ref_name, **kwargs)
    seed_parameters_(ref, seed)
    ours = create_model(ref_name + "_ls", **kwargs)
    ours.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
    return ref.eval(), ours.eval()


@pytest.fixture(scope="module")
def xxs24():
    return _pair("cait_xxs24_224")


@pytest.fixture(scope="module")
def images():
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))


@pytest.mark.compat
def test_the_model_is_timms_cait():
    from timm.models.cait import Cait, ClassAttn, TalkingHeadAttn

    model = create_model("cait_xxs24_224_ls", device="meta")
    assert isinstance(model, Cait) and type(model.blocks[0].attn) is TalkingHeadAttn
    assert type(model.blocks_token_only[0].attn) is ClassAttn


@pytest.mark.compat
@pytest.mark.parametrize("name", [n for n in timm.list_models("*_ls") if n in VARIANTS])
@pytest.mark.full
def test_registry_meta_build_and_pretrained_cfg(name):
    model = create_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    cfg = model.pretrained_cfg
    ref = VARIANTS[name].reference
    assert cfg["tag"] == "fb_dist_in1k"
    assert cfg["hf_hub_id"] == f"timm/{ref}.fb_dist_in1k"
    assert cfg["url"].startswith("https://dl.fbaipublicfiles.com/deit/") and cfg["url"].endswith(".pth")
    assert cfg["input_size"] == (3, IMG[name], IMG[name])
    assert cfg["num_classes"] == 1000 and cfg["license"] == "apache-2.0"
    assert timm.list_pretrained(f"{name}.*") == [f"{name}.fb_dist_in1k"]
    # Same architecture as the reference: key for key and shape for shape.
    ref_model = create_model(str(ref), device="meta")
    assert cfg["url"] == ref_model.pretrained_cfg["url"]
    # Evaluated as timm evaluates the reference: the same resize, crop and normalisation.
    data = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode", "test_input_size", "first_conv")
    assert {k: cfg.get(k) for k in data} == {k: ref_model.pretrained_cfg.get(k) for k in data}
    mapped = {k: tuple(v.shape) for k, v in to_layerscale(ref_model.state_dict(), "cait").items()}
    assert mapped == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert model.blocks[0].ls1.init_value == VARIANTS[name].init_value


@pytest.mark.compat
def test_forward_bit_exact(xxs24, images):
    ref, ours = xxs24
    with torch.no_grad():
        a, b = ref(images), ours(images)
    assert torch.equal(a, b)
    # The check is not vacuous: the gates matter and the logits are far from constant.
    assert a.std() > 0.1


def test_forward_features_and_intermediates_bit_exact(xxs24, images):
    ref, ours = xxs24
    with torch.no_grad():
        assert torch.equal(ref.forward_features(images), ours.forward_features(images))
        fa, ia = ref.forward_intermediates(images, indices=[0, 11, 23])
        fb, ib = ours.forward_intermediates(images, indices=[0, 11, 23])
        assert torch.equal(fa, fb)
        assert len(ia) == len(ib) == 3 and all(torch.equal(x, y) for x, y in zip(ia, ib, strict=True))
        assert ib[0].shape == (2, 192, 14, 14)
        na = ref.forward_intermediates(images, indices=2, norm=True, output_fmt="NLC", intermediates_only=True)
        nb = ours.forward_intermediates(images, indices=2, norm=True, output_fmt="NLC", intermediates_only=True)
        assert all(torch.equal(x, y) for x, y in zip(na, nb, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n != "cait_xxs24_224_ls"])
def test_every_variant_bit_exact(name):
    ref, ours = _pair(str(VARIANTS[name].reference))
    x = torch.randn(1, 3, IMG[name], IMG[name], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ref(x), ours(x))


def _official_forward(sd: dict, x: torch.Tensor, num_heads: int, patch: int) -> torch.Tensor:
    """CaiT written out from the paper's equations with hand-computed attention."""

    def ln(t, p):
        return F.layer_norm(t, t.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps=1e-6)

    def lin(t, p):
        return F.linear(t, sd[p + ".weight"], sd.get(p + ".bias"))

    def mlp(t, p):
        return lin(F.gelu(lin(t, p + ".fc1")), p + ".fc2")

    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch)
    t = t.flatten(2).transpose(1, 2) + sd["pos_embed"]
    B, N, C = t.shape
    H = num_heads
    scale = (C // H) ** -0.5
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        p = f"blocks.{i}"
        qkv = lin(ln(t, p + ".norm1"), p + ".attn.qkv").reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = lin(attn.permute(0, 2, 3, 1), p + ".attn.proj_l").permute(0, 3, 1, 2)
        attn = attn.softmax(dim=-1)
        attn = lin(attn.permute(0, 2, 3, 1), p + ".attn.proj_w").permute(0, 3, 1, 2)
        a = lin((attn @ v).transpose(1, 2).reshape(B, N, C), p + ".attn.proj")
        t = t + sd[p + ".gamma_1"] * a
        t = t + sd[p + ".gamma_2"] * mlp(ln(t, p + ".norm2"), p + ".mlp")
    cls = sd["cls_token"].expand(B, -1, -1)
    for j in range(2):
        p = f"blocks_token_only.{j}"
        u = ln(torch.cat((cls, t), dim=1), p + ".norm1")
        q = lin(u[:, 0], p + ".attn.q").unsqueeze(1).reshape(B, 1, H, C // H).permute(0, 2, 1, 3)
        k = lin(u, p + ".attn.k").reshape(B, N + 1, H, C // H).permute(0, 2, 1, 3)
        v = lin(u, p + ".attn.v").reshape(B, N + 1, H, C // H).permute(0, 2, 1, 3)
        attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        a = lin((attn @ v).transpose(1, 2).reshape(B, 1, C), p + ".attn.proj")
        cls = cls + sd[p + ".gamma_1"] * a
        cls = cls + sd[p + ".gamma_2"] * mlp(ln(cls, p + ".norm2"), p + ".mlp")
    t = ln(torch.cat((cls, t), dim=1), "norm")
    return lin(t[:, 0], "head")


def test_unfused_attention_equals_official_math(images):
    """With fused attention off, converted model == hand-written official math, bit for bit."""
    set_fused_attn(False)
    try:
        ref, ours = _pair("cait_xxs24_224")
    finally:
        set_fused_attn(True)
    assert not ours.blocks_token_only[0].attn.fused_attn
    official = {k: v.detach().clone().requires_grad_() for k, v in to_gamma(ours.state_dict(), "cait").items()}
    x = images[:1]
    assert reduction_trace(lambda: _official_forward(official, x, 4, 16)) == reduction_trace(lambda: ref(x))
    with torch.no_grad():
        expected = _official_forward(official, images, num_heads=4, patch=16)
        assert torch.equal(ours(images), expected)
        assert torch.equal(ref(images), expected)


@pytest.mark.parametrize(("amp", "fused"), [(False, True), (True, False)], ids=["fp32-fused", "bf16-unfused"])
@pytest.mark.full
def test_compiled_models_make_one_graph(tiny_cait_kwargs, fused, amp):  # each value of each setting once
    """``torch.compile`` makes timm's ATen graph of the converted model, in fp32 and under bf16
    autocast, up to the order of independent calls and of a multiply's operands (timm's
    ``gamma_1 * x``, LayerScale's ``x * gamma``: they round alike), so the code it generates
    computes alike. So too for the graph for any batch size, which dynamo compiles once a second
    batch size arrives (an evaluation's last batch). One self-attention block stands for any depth:
    the blocks are one module repeated, and tracing each costs seconds."""
    set_fused_attn(fused)
    try:
        ref, ours = _pair("cait_xxs24_224", **{**tiny_cait_kwargs, "depth": 1})
    finally:
        set_fused_attn(True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        for dynamic in (False, True):
            assert compiled_graph(ours, x, dynamic=dynamic) == compiled_graph(ref, x, dynamic=dynamic)


@pytest.mark.slow  # inductor compiles its C++ kernels: about 40 s on a cold cache
def test_inductors_code_computes_alike(tiny_cait_kwargs):
    """The code inductor generates from those graphs, for timm's default (fp32, fused attention): the compiled
    models' outputs are ``torch.equal``, at two batch sizes."""
    ref, ours = _pair("cait_xxs24_224", **{**tiny_cait_kwargs, "depth": 1})
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    compiled_ours, compiled_ref = torch.compile(ours), torch.compile(ref)
    with torch.inference_mode():
        for batch in (x, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))):
            expected = compiled_reference(compiled_ref, batch)
            assert torch.equal(compiled_ours(batch), expected)


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory, xxs24):
    ref, _ = xxs24
    d = tmp_path_factory.mktemp("weights")
    sd = ref.state_dict()
    torch.save({"model": {"module." + k: v for k, v in sd.items()}, "epoch": 3}, d / "XXS24_224.pth")
    save_file({k: v.contiguous() for k, v in sd.items()}, d / "timm_gamma.safetensors")
    save_file({k: v.contiguous() for k, v in to_layerscale(sd, "cait").items()}, d / "ls.safetensors")
    return d


@pytest.mark.compat
@pytest.mark.parametrize("fname", ["XXS24_224.pth", "timm_gamma.safetensors", "ls.safetensors"])
def test_pretrained_from_any_layout(weight_files, xxs24, images, fname):
    ref, _ = xxs24
    model = create_model(
        "cait_xxs24_224_ls", pretrained=True, pretrained_cfg_overlay=dict(file=str(weight_files / fname))
    ).eval()
    with torch.no_grad():
        assert torch.equal(model(images), ref(images))


@pytest.mark.compat
def test_pretrained_at_another_img_size(weight_files, xxs24):
    ref, _ = xxs24
    model = create_model(
        "cait_xxs24_224_ls",
        pretrained=True,
        img_size=288,
        pretrained_cfg_overlay=dict(file=str(weight_files / "XXS24_224.pth")),
    ).eval()
    assert model.pos_embed.shape == (1, 18 * 18, 192)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 288, 288))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    assert torch.equal(model.blocks[3].ls2.gamma, ref.blocks[3].gamma_2)


def test_dynamic_img_size(tiny_cait_kwargs):
    torch.manual_seed(0)
    static = CaitLS(**tiny_cait_kwargs).eval()
    dynamic = CaitLS(**tiny_cait_kwargs, dynamic_img_size=True).eval()
    dynamic.load_state_dict(static.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(static(x), dynamic(x))
        assert dynamic(torch.randn(2, 3, 48, 40)).shape == (2, 10)
        feats = dynamic.forward_intermediates(torch.randn(1, 3, 48, 40), intermediates_only=True)
    assert isinstance(feats, list) and feats[-1].shape == (1, 32, 6, 5)


@pytest.mark.compat
def test_model_contract(tiny_cait_kwargs):
    torch.manual_seed(0)
    model = CaitLS(**tiny_cait_kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 1 + 16, 32)
        assert model.forward_head(feats, pre_logits=True).shape == (2, 32)
        assert torch.equal(model.forward_head(feats), model(x))
    assert model.get_classifier() is model.head
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    model.reset_classifier(5)
    assert model(x).shape == (2, 5)
    model.reset_classifier(0, "avg")
    assert model(x).shape == (2, 32)
    groups = timm.models.group_parameters(model, model.group_matcher())
    assert len(groups) >= len(model.blocks)


@pytest.mark.compat
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.full
def test_fx_feature_extraction_and_torchscript(tiny_cait_kwargs, dynamic, device):
    torch.manual_seed(0)
    kwargs = dict(tiny_cait_kwargs, dynamic_img_size=dynamic)
    model = create_model("cait_xxs24_224_ls", **kwargs).eval()
    features = create_model("cait_xxs24_224_ls", **kwargs, features_only=True, feature_cls="fx", out_indices=(1,))
    x = torch.randn(2, 3, 32, 48 if dynamic else 32).to(device)
    assert_traces_and_scripts(model, x, features.eval())


@pytest.mark.parametrize("attn_impl", ["buffered", "fast"])
def test_fx_traces_the_reference_formulation_of_every_attn_impl(tiny_cait_kwargs, attn_impl):
    torch.manual_seed(0)
    reference = create_model("cait_xxs24_224_ls", **tiny_cait_kwargs).eval()
    model = create_model("cait_xxs24_224_ls", **tiny_cait_kwargs, attn_impl=attn_impl).eval()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        traced = timm.models.create_feature_extractor(model, return_nodes=["head"])(x)["head"]
        assert torch.equal(traced, reference(x))


@pytest.mark.compat
def test_features_only_and_prune():
    model = create_model("cait_xxs24_224_ls", features_only=True, out_indices=(5, 23), device="meta")
    assert model.feature_info.channels() == [192, 192]
    tiny = create_model("cait_xxs24_224_ls", img_size=64, depth=4).eval()
    taken = tiny.prune_intermediate_layers(indices=[1], prune_head=True)
    assert taken == [1] and len(tiny.blocks) == 2 and tiny.blocks_token_only is None
    out = tiny.forward_intermediates(torch.randn(1, 3, 64, 64), indices=[1], intermediates_only=True)
    assert out[0].shape == (1, 192, 4, 4)


def test_meta_build_all_variants_loads_with_assign():
    model = create_model("cait_m48_448_ls", device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert math.isclose(n / 1e6, 356.5, rel_tol=1e-3)
    # off the meta device, timm's initialisation still runs: truncated normal linears, zero biases
    weight, bias = (p.detach() for p in CaitLS(**TINY_CAIT).blocks[0].mlp.fc1.parameters())  # type: ignore[union-attr]
    assert math.isclose(weight.std().item(), 0.02, rel_tol=0.1) and not bias.any()


def test_bad_config_errors(tiny_cait_kwargs):
    with pytest.raises(ValueError, match="global_pool"):
        CaitLS(**tiny_cait_kwargs, global_pool="max")
    with pytest.raises(ValueError, match="init_values"):
        CaitLS(**dict(tiny_cait_kwargs, init_values="big"))
