"""LayerScale, the CaiT init rule and optimizer parameter groups."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from timm_layerscale import LayerScale, cait_init_value, param_groups


def _tagged(p: torch.Tensor) -> bool:
    return getattr(p, "_no_weight_decay", False) is True


@pytest.mark.parametrize("shape", [(2, 5, 8), (2, 3, 4, 8), (2, 3, 4, 5, 8), (8,)])
def test_forward_broadcasts_over_leading_axes(shape):
    torch.manual_seed(0)
    ls = LayerScale(8, init_value=0.5)
    with torch.no_grad():
        ls.gamma.copy_(torch.randn(8))
    x = torch.randn(shape)
    y = ls(x)
    assert y.shape == x.shape
    for c in range(8):
        assert torch.equal(y[..., c], x[..., c] * ls.gamma[c])


def test_init_value_and_defaults():
    ls = LayerScale(6)
    assert ls.gamma.shape == (6,)
    assert torch.all(ls.gamma == 1e-4)
    assert isinstance(ls.gamma, nn.Parameter)
    assert torch.all(LayerScale(3, init_value=1e-5).gamma == 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_keeps_its_dtype(dtype):
    ls = LayerScale(4, init_value=0.3)
    x = torch.randn(2, 3, 4).to(dtype)
    y = ls(x)
    assert y.dtype == dtype
    assert torch.equal(y, x * ls.gamma.detach().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_promote_multiplies_as_timm_and_the_official_blocks(dtype):
    ls = LayerScale(4, init_value=0.3, promote=True)
    with torch.no_grad():
        ls.gamma.copy_(torch.tensor([0.1, -0.7, 1.3, 3e-3]))
    x = torch.randn(2, 3, 4).to(dtype)
    y = ls(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, ls.gamma.detach() * x)  # the official blocks' gamma_1 * x
    assert "promote=True" in repr(ls) and "promote" not in repr(LayerScale(4))


def test_model_blocks_promote(tiny_cait_kwargs):
    from helpers import create_model

    model = create_model("cait_xxs24_224_ls", **tiny_cait_kwargs)
    gates = [m for m in model.modules() if isinstance(m, LayerScale)]
    assert gates and all(m.promote for m in gates)


def test_wrong_sizes_are_refused():
    with pytest.raises(ValueError, match=r"8.*7|7.*8"):
        LayerScale(8)(torch.randn(2, 7))
    with pytest.raises(ValueError):
        LayerScale(0)


def test_flop_count_and_repr():
    ls = LayerScale(192, init_value=1e-5)
    assert ls.flop_count(197) == 197 * 192
    assert "dim=192" in repr(ls) and "1e-05" in repr(ls)


def test_reset_parameters():
    ls = LayerScale(4, init_value=0.25)
    with torch.no_grad():
        ls.gamma.fill_(3.0)
    ls.reset_parameters()
    assert torch.all(ls.gamma == 0.25)
    assert _tagged(ls.gamma)


def test_builds_on_meta_and_the_tag_survives_copies_moves_and_loads():
    assert LayerScale(16, device="meta").gamma.is_meta
    with torch.device("meta"):
        assert LayerScale(16).gamma.is_meta
    assert _tagged(copy.deepcopy(nn.Sequential(nn.Linear(4, 4), LayerScale(4))).get_parameter("1.gamma"))
    assert _tagged(LayerScale(4, device="meta").to_empty(device="cpu").gamma)
    assigned = LayerScale(4, device="meta")
    assigned.load_state_dict({"gamma": torch.full((4,), 0.5)}, assign=True)
    assert torch.all(assigned.gamma == 0.5) and _tagged(assigned.gamma)
    moved = LayerScale(4).to(torch.float64)
    assert moved.gamma.dtype == torch.float64 and _tagged(moved.gamma)


@pytest.mark.parametrize(
    "depth, value", [(1, 0.1), (12, 0.1), (18, 0.1), (19, 1e-5), (24, 1e-5), (25, 1e-6), (36, 1e-6), (48, 1e-6)]
)
def test_cait_init_value_rule(depth, value):
    assert cait_init_value(depth) == value


def test_cait_init_value_rejects_bad_depth():
    with pytest.raises(ValueError):
        cait_init_value(0)


def test_auto_init_values_in_models(tiny_cait_kwargs):
    from timm_layerscale.models.cait_ls import CaitLS

    kw = dict(tiny_cait_kwargs, init_values="auto", depth=20)
    model = CaitLS(**kw)
    assert torch.all(model.get_parameter("blocks.0.ls1.gamma") == 1e-5)
    none = CaitLS(**dict(tiny_cait_kwargs, init_values=None))
    assert isinstance(none.blocks[0].ls1, nn.Identity)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(1, 4, 8))
        self.tagged = nn.Parameter(torch.randn(8, 8))
        self.tagged._no_weight_decay = True  # type: ignore[attr-defined]  # timm's tag, set as users set it
        self.fc = nn.Linear(8, 8)
        self.ls = LayerScale(8, init_value=0.5)

    def no_weight_decay(self):
        return {"embed"}

    def forward(self, x):
        return self.ls(self.fc(x + self.embed) @ self.tagged)


def test_param_groups_honour_tags_types_and_names():
    model = _Toy()
    # A gamma that lost its tag (e.g. replaced by hand) is still found by module type.
    model.ls.gamma.__dict__.pop("_no_weight_decay", None)
    groups = param_groups(model, weight_decay=0.05)
    no_decay = {id(p) for p in groups[0]["params"]}
    decay = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["weight_decay"] == 0.05
    assert id(model.ls.gamma) in no_decay
    assert id(model.tagged) in no_decay
    assert id(model.embed) in no_decay
    assert id(model.fc.bias) in no_decay
    assert decay == {id(model.fc.weight)}


def test_param_groups_on_cait(tiny_cait_kwargs):
    from timm_layerscale.models.cait_ls import CaitLS

    model = CaitLS(**tiny_cait_kwargs)
    groups = param_groups(model, 0.05)
    no_decay = {id(p) for p in groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in no_decay}
    assert {"pos_embed", "cls_token", "blocks.0.ls1.gamma", "blocks_token_only.1.ls2.gamma"} <= names
    assert "blocks.0.attn.qkv.weight" not in names
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
