"""ViT-5: the model, its checkpoint filter, the ``vit5`` key rules and the official-layout reference."""

from __future__ import annotations

import argparse
import math
from typing import Any, cast

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_layerscale  # noqa: F401  (registers the models)
from helpers import DEVICES, TORCH_VERSION, assert_traces_and_scripts, create_model, detected
from timm_layerscale.authors import vit5 as vit5_official
from timm_layerscale.conversion import rules as remap
from timm_layerscale.errors import RemapError
from timm_layerscale.families import get_variant
from timm_layerscale.families.vit5 import official_model, rope_buffers
from timm_layerscale.models import vit5
from timm_layerscale.parity.references import load_model, model_name

NAMES = list(vit5.VARIANTS)
RELEASED = [n for n in NAMES if "xlarge" not in n]
TINY = dict(embed_dim=64, depth=2, num_heads=2)
PATCH_THETA, REG_THETA, REGS = 10000.0, 100.0, 4
PARITY_ATOL = 1e-5


def _official_freqs(head_dim: int, theta: int) -> torch.Tensor:
    """The buffer as the official code fills it (fp32, on the CPU, at construction)."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))


def official_state_dict(
    embed_dim: int, depth: int, num_heads: int, grid: int, num_classes: int = 1000, seed: int = 0, in_chans: int = 3
) -> dict[str, torch.Tensor]:
    """An official ViT-5 state dict (key for key) with every entry random; gammas ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    dim, heads = embed_dim, num_heads

    def rnd(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=g)

    hd, hidden = dim // heads, 4 * dim
    sd = {
        "cls_token": rnd(1, 1, dim, std=0.1),
        "reg_token": rnd(1, REGS, dim, std=0.1),
        "pos_embed": rnd(1, grid * grid, dim, std=0.1),
        "patch_embed.proj.weight": rnd(dim, in_chans, 16, 16, std=(in_chans * 256) ** -0.5),
        "patch_embed.proj.bias": rnd(dim, std=0.1),
    }
    for i in range(depth):
        p = f"blocks.{i}."
        sd.update(
            {
                p + "gamma_1": rnd(dim, std=0.1),
                p + "gamma_2": rnd(dim, std=0.1),
                p + "norm1.weight": rnd(dim, std=0.1, mean=1.0),
                p + "attn.qkv.weight": rnd(3 * dim, dim, std=dim**-0.5),
                p + "attn.proj.weight": rnd(dim, dim, std=dim**-0.5),
                p + "attn.proj.bias": rnd(dim, std=0.1),
                p + "attn.q_norm.weight": rnd(hd, std=0.1, mean=1.0),
                p + "attn.k_norm.weight": rnd(hd, std=0.1, mean=1.0),
                p + "attn.rope.freqs": _official_freqs(hd, 10000),
                p + "attn.rope_reg.freqs": _official_freqs(hd, 100),
                p + "norm2.weight": rnd(dim, std=0.1, mean=1.0),
                p + "mlp.fc1.weight": rnd(hidden, dim, std=dim**-0.5),
                p + "mlp.fc1.bias": rnd(hidden, std=0.1),
                p + "mlp.fc2.weight": rnd(dim, hidden, std=hidden**-0.5),
                p + "mlp.fc2.bias": rnd(dim, std=0.1),
            }
        )
    sd["norm.weight"] = rnd(dim, std=0.1, mean=1.0)
    if num_classes:
        sd["head.weight"] = rnd(num_classes, dim, std=dim**-0.5)
        sd["head.bias"] = rnd(num_classes, std=0.1)
    return sd


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rotations(rows: int, cols: int, ref: tuple[float, float], hd: int, theta: float) -> torch.Tensor:
    """Unit complex numbers ``(rows * cols, hd / 2)``: pair ``j`` of a token at ``(r, c)``."""
    quarter = hd // 4
    freq = theta ** -(torch.arange(quarter, dtype=torch.float64) / quarter)
    y = torch.arange(rows, dtype=torch.float64) / rows * ref[0]
    x = torch.arange(cols, dtype=torch.float64) / cols * ref[1]
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    angle = torch.cat((yy.reshape(-1, 1) * freq, xx.reshape(-1, 1) * freq), dim=1)
    return torch.polar(torch.ones_like(angle), angle)


def _rotate(t: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Multiply each adjacent channel pair ``(a, b)`` of ``t (..., N, hd)`` as ``a + ib`` by ``rot (N, hd/2)``."""
    z = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * rot).reshape(t.shape)


def independent_forward(
    sd: dict[str, torch.Tensor],
    x: torch.Tensor,
    heads: int,
    train_grid: tuple[int, int] | None = None,
    pos_embed: torch.Tensor | None = None,
) -> torch.Tensor:
    """ViT-5 logits from an official state dict, in float64, from the published math."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    B = x.shape[0]
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=16)
    rows, cols = t.shape[-2:]
    pos = sd["pos_embed"] if pos_embed is None else pos_embed.double()
    t = t.flatten(2).transpose(1, 2) + pos
    t = torch.cat((sd["cls_token"].expand(B, -1, -1), t, sd["reg_token"].expand(B, -1, -1)), dim=1)
    N, D = t.shape[1:]
    hd = D // heads
    ref = train_grid or (rows, cols)
    rot = torch.cat(
        (
            torch.ones(1, hd // 2, dtype=torch.complex128),  # class token: not rotated
            _rotations(rows, cols, ref, hd, PATCH_THETA),
            _rotations(2, 2, (2, 2), hd, REG_THETA),
        )
    )
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        p = f"blocks.{i}."
        h = _rms(t, sd[p + "norm1.weight"])
        q, k, v = (h @ sd[p + "attn.qkv.weight"].T).reshape(B, N, 3, heads, hd).permute(2, 0, 3, 1, 4)
        q = _rotate(_rms(q, sd[p + "attn.q_norm.weight"]), rot)
        k = _rotate(_rms(k, sd[p + "attn.k_norm.weight"]), rot)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
        a = a.transpose(1, 2).reshape(B, N, D) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        t = t + sd[p + "gamma_1"] * a
        h = _rms(t, sd[p + "norm2.weight"])
        h = F.gelu(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
        t = t + sd[p + "gamma_2"] * (h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"])
    t = _rms(t, sd["norm.weight"])
    return t[:, 0] @ sd["head.weight"].T + sd["head.bias"]


def images(n: int, size: int | tuple[int, int], seed: int = 0) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def tiny(img: int = 32, **kwargs: Any) -> Any:
    return create_model("vit5_small_patch16_224", img_size=img, **dict(TINY, **kwargs))


def load_official(model: Any, sd: dict[str, torch.Tensor]) -> Any:
    model.load_state_dict(vit5.checkpoint_filter_fn({"model": sd}, model), strict=True)
    return model.eval()


def set_fused_attn(model: torch.nn.Module, fused: bool) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            setattr(m, "fused_attn", fused)  # noqa: B010  (typed Tensor | Module on nn.Module)


def parity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return (a.double() - b.double()).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).double().mean().item()


@pytest.mark.parametrize("img", [32, 48, 384])
@pytest.mark.parametrize("fused", [True, False])
def test_parity_with_independent_forward_tiny(img: int, fused: bool) -> None:
    """Grids 2, 3 (positions i / 3 * 3, not exact in fp32) and 24 (the 384 models)."""
    grid = img // 16
    sd = official_state_dict(**TINY, grid=grid, seed=img)
    model = load_official(tiny(img), sd)
    set_fused_attn(model, fused)
    x = images(8, img, seed=1)
    with torch.no_grad():
        out = model(x)
    ref = independent_forward(sd, x, TINY["num_heads"])
    diff, top1 = parity(out, ref)
    print(f"vit5 tiny img={img} fused_attn={fused}: max abs diff {diff:.3g}, top-1 agreement {top1:.0%}")
    assert diff <= PARITY_ATOL
    assert top1 == 1.0


@pytest.mark.compat
@pytest.mark.parametrize("img", [32, 48, 384])
def test_package_matches_reference_module_within_tolerance(img: int) -> None:
    # Two implementations of the same equations, reductions ordered differently: a tolerance, not equality.
    sd = official_state_dict(**TINY, grid=img // 16, seed=11)
    ref = vit5_official.Vit5Official(img_size=img, **TINY).eval()
    ref.load_state_dict(sd, strict=True)
    model = load_official(tiny(img), sd)
    x = images(4, img, seed=12)
    with torch.no_grad():
        expected = ref(x)
        set_fused_attn(model, False)
        assert parity(model(x), expected)[0] <= PARITY_ATOL
        set_fused_attn(model, True)
        assert parity(model(x), expected)[0] <= PARITY_ATOL


def test_reference_interface_loads_official_and_converted_weights() -> None:
    sd = official_state_dict(384, 12, 6, grid=14, seed=5)
    v = get_variant("vit5_small_patch16_224")
    loaded = load_model(v, v.family.layouts["official"], sd)  # the official file's own tensors
    assert loaded.state_dict().keys() == sd.keys() and not loaded.training
    assert all(torch.equal(loaded.state_dict()[k], sd[k]) for k in sd)
    assert model_name(v, v.family.layouts["official"]) == "vit5_official/vit5_small_patch16_224"
    converted = load_model(v, v.family.layouts["ls"], remap.to_layerscale(sd, "vit5"))  # this package's model
    assert model_name(v, v.family.layouts["ls"]) == "vit5_small_patch16_224"
    assert converted.state_dict().keys() == remap.to_layerscale(sd, "vit5").keys() and not converted.training


@pytest.mark.parametrize("name", NAMES)
def test_official_freqs_equal_computed_tables(name: str) -> None:
    v = vit5.VARIANTS[name]
    computed = rope_buffers(v)
    with torch.device("meta"):
        keys = [k for k in official_model(v).state_dict() if k.endswith(".freqs")]
    one = vit5_official.Attention(v.embed_dim, v.num_heads, v.img_size // v.patch_size, 4, 100)  # every block's
    official = {k: one.state_dict()[k.split(".", 3)[3]] for k in keys}
    assert computed.keys() == official.keys()
    assert all(torch.equal(computed[k], official[k]) for k in computed)
    depth, hd = v.depth, v.embed_dim // v.num_heads
    assert len(computed) == 2 * depth
    exact = PATCH_THETA ** -(torch.arange(hd // 4, dtype=torch.float64) / (hd // 4))
    torch.testing.assert_close(computed["blocks.0.attn.rope.freqs"].double(), exact, rtol=1e-6, atol=0)


def test_filter_checks_and_drops_freqs() -> None:
    sd = official_state_dict(**TINY, grid=2)
    model = tiny(32)
    out = vit5.checkpoint_filter_fn(sd, model)
    assert not any(k.endswith(".freqs") for k in out)
    bad = dict(sd, **{"blocks.1.attn.rope.freqs": sd["blocks.1.attn.rope.freqs"] * 1.01})
    with pytest.raises(RemapError, match="rotary"):
        vit5.checkpoint_filter_fn(bad, model)
    short = dict(sd, **{"blocks.0.attn.rope_reg.freqs": sd["blocks.0.attn.rope_reg.freqs"][:4]})
    with pytest.raises(RemapError, match="rotary"):
        vit5.checkpoint_filter_fn(short, model)


@pytest.mark.parametrize("name", NAMES)
def test_layout_matches_official_reference_on_meta(name: str) -> None:
    with torch.device("meta"):
        ref = official_model(vit5.VARIANTS[name])
        model = create_model(name)
    official = {**ref.state_dict(), **rope_buffers(vit5.VARIANTS[name])}  # the buffers' values, proven computed
    converted = remap.to_layerscale(official, "vit5")
    remap.check_state_dict(converted, model.state_dict(), name)
    assert detected(official).variant.name == name


def _training_dict(sd: dict, ema: dict) -> dict:
    return {
        "model": sd,
        "model_ema": ema,
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
        "lr_scheduler": {"last_epoch": 799},
        "epoch": 799,
        "scaler": {"scale": 65536.0},
        "args": argparse.Namespace(model="vit5_small", input_size=32),
    }


def test_training_dict_file_loads_through_timm(tmp_path) -> None:
    sd, ema = official_state_dict(**TINY, grid=2, seed=21), official_state_dict(**TINY, grid=2, seed=22)
    path = tmp_path / "vit5_tiny_training.pth"
    torch.save(_training_dict(sd, ema), path)
    x = images(4, 32, seed=23)
    # timm's file loader unwraps training dicts itself and prefers 'model_ema'
    model = tiny(32, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    with torch.no_grad():
        diff, top1 = parity(model(x), independent_forward(ema, x, 2))
    assert diff <= PARITY_ATOL and top1 == 1.0
    # handed the whole dict, the filter takes 'model', or 'model_ema' for an *_ema tag
    ckpt = torch.load(path, weights_only=False)
    for tag, expected in (("in1k", sd), ("in1k_ema", ema)):
        model = tiny(32, pretrained=True, pretrained_cfg_overlay=dict(state_dict=ckpt, tag=tag)).eval()
        for k, v in remap.to_layerscale(expected, "vit5").items():
            assert torch.equal(model.state_dict()[k], v), (tag, k)


def test_filter_ema_selection_and_errors() -> None:
    sd, ema = official_state_dict(**TINY, grid=2, seed=1), official_state_dict(**TINY, grid=2, seed=2)
    model = tiny(32)
    assert vit5.checkpoint_filter_fn({"model": sd, "model_ema": ema}, model)["cls_token"] is sd["cls_token"]
    assert (
        vit5.checkpoint_filter_fn({"model": sd, "model_ema": ema}, model, use_ema=True)["cls_token"] is ema["cls_token"]
    )
    assert vit5.checkpoint_filter_fn(sd, model, use_ema=True)["cls_token"] is sd["cls_token"]
    with pytest.raises(RemapError, match="model_ema"):
        vit5.checkpoint_filter_fn({"model": sd}, model, use_ema=True)
    prefixed = {"model": {"module." + k: v for k, v in sd.items()}}
    assert vit5.checkpoint_filter_fn(prefixed, model).keys() == model.state_dict().keys()


def test_filter_resamples_pos_embed_for_another_img_size() -> None:
    sd = official_state_dict(**TINY, grid=2)
    model = tiny(64)
    out = vit5.checkpoint_filter_fn(sd, model)
    assert out["pos_embed"].shape == (1, 16, 64)
    model.load_state_dict(out, strict=True)


@pytest.mark.compat
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.full
def test_fx_feature_extraction_and_torchscript(dynamic: bool, device: str) -> None:
    torch.manual_seed(0)
    features = tiny(32, dynamic_img_size=dynamic, features_only=True, feature_cls="fx", out_indices=(1,))
    x = images(2, (48, 64) if dynamic else 32).to(device)
    model = tiny(32, dynamic_img_size=dynamic).eval()
    # torch 2.5's rms_norm fixes the batch size of an exported program
    assert_traces_and_scripts(model, x, features.eval(), dynamic_batch=TORCH_VERSION >= (2, 6))


def test_pretrained_cfgs() -> None:
    tags = timm.list_pretrained("vit5_*")
    assert sorted(t for t in tags if not t.endswith("_ema")) == sorted(f"{n}.in1k" for n in RELEASED)
    for name in RELEASED:
        cfg: Any = timm.models.get_pretrained_cfg(f"{name}.in1k")
        assert cfg.hf_hub_id == "FengWang3211/ViT-5" and cfg.hf_hub_filename == f"{name}.pth"
        assert cfg.input_size[-1] == int(name[-3:]) and cfg.num_classes == 1000
        ema: Any = timm.models.get_pretrained_cfg(f"{name}.in1k_ema")
        assert ema.hf_hub_filename == f"{name}.pth"
    xlarge: Any = timm.models.get_pretrained_cfg("vit5_xlarge_patch16_224")
    assert not xlarge.has_weights


def test_init_and_registers() -> None:
    model = tiny(32)
    assert model.reg_token.shape == (1, 4, 64)
    assert torch.all(model.blocks[0].ls1.gamma == 1e-4)
    assert model.no_weight_decay() == {"pos_embed", "cls_token", "reg_token"}
    assert model.forward_features(images(2, 32)).shape == (2, 1 + 4 + 4, 64)
    with pytest.raises(ValueError, match="square"):
        tiny(32, reg_tokens=3)
    with pytest.raises(ValueError, match="divisible by 4"):
        tiny(32, embed_dim=60, num_heads=2)


def test_forward_intermediates() -> None:
    model = tiny(48).eval()
    x = images(2, 48)
    final, inter = model.forward_intermediates(x)
    assert final.shape == (2, 1 + 9 + 4, 64) and len(inter) == 2
    assert all(t.shape == (2, 64, 3, 3) for t in inter)
    tokens = model.forward_features(x)
    torch.testing.assert_close(final, tokens)
    nlc = model.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)
    assert nlc[0].shape == (2, 9, 64)
    pairs = model.forward_intermediates(x, indices=1, return_prefix_tokens=True, norm=True, intermediates_only=True)
    patches, prefix = pairs[0]
    assert prefix.shape == (2, 5, 64)
    torch.testing.assert_close(prefix[:, 0], tokens[:, 0])
    torch.testing.assert_close(prefix[:, 1:], tokens[:, -4:])
    torch.testing.assert_close(patches.flatten(2).transpose(1, 2), tokens[:, 1:-4])
    empty = model.forward_intermediates(x[:0], intermediates_only=True)  # a data-parallel run's empty shard
    assert [t.shape for t in empty] == [(0, 64, 3, 3)] * 2 and model(x[:0]).shape == (0, model.num_classes)


def test_features_only_and_prune() -> None:
    feats = create_model("vit5_small_patch16_224", img_size=32, **TINY, features_only=True, out_indices=(0, 1))
    out = feats(images(2, 32))
    assert [tuple(o.shape) for o in out] == [(2, 64, 2, 2)] * 2
    assert feats.feature_info.channels() == [64, 64] and feats.feature_info.reduction() == [16, 16]
    model = tiny(32)
    assert model.prune_intermediate_layers([0]) == [0]
    assert len(model.blocks) == 1 and isinstance(model.head, torch.nn.Identity)


def test_dynamic_img_size() -> None:
    sd = official_state_dict(**TINY, grid=2, seed=51)
    static = load_official(tiny(32), sd)
    dynamic = load_official(tiny(32, dynamic_img_size=True), sd)
    x = images(2, 32)
    with torch.no_grad():
        assert torch.equal(dynamic(x), static(x))
        y = images(3, (48, 64), seed=52)
        out = dynamic(y)
        inter = dynamic.forward_intermediates(y, intermediates_only=True)
    assert isinstance(inter, list) and inter[-1].shape == (3, 64, 3, 4)
    from timm.layers import resample_abs_pos_embed

    pos = resample_abs_pos_embed(sd["pos_embed"], new_size=(3, 4), old_size=(2, 2), num_prefix_tokens=0)
    ref = independent_forward(sd, y, 2, train_grid=(2, 2), pos_embed=pos)
    diff, top1 = parity(out, ref)
    assert diff <= PARITY_ATOL and top1 == 1.0


def test_classifier_and_pooling() -> None:
    model = tiny(32)
    assert model.get_classifier() is model.head
    model.reset_classifier(10, "avg")
    assert model(images(2, 32)).shape == (2, 10)
    tokens = model.forward_features(images(2, 32))
    torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), tokens[:, 1:-4].mean(1))
    model.reset_classifier(0)
    assert model(images(2, 32)).shape == (2, 64)
    with pytest.raises(ValueError):
        model.reset_classifier(10, "max")
    matcher = model.group_matcher()
    assert set(matcher) == {"stem", "blocks"}


def test_grad_checkpointing_matches() -> None:
    torch.manual_seed(0)
    model = tiny(32)
    x = images(2, 32)
    model(x).sum().backward()
    grads = {k: cast(torch.Tensor, p.grad).clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k])
