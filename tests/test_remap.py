"""Key rules between the gamma and LayerScale-module layouts."""

from __future__ import annotations

import pytest
import timm
import torch
from hypothesis import strategies as st

import timm_layerscale  # noqa: F401
from timm_layerscale.conversion.checkpoint import state_dict_of, strip_prefixes, unwrap_state_dict
from timm_layerscale.conversion.rules import check_state_dict, to_gamma, to_layerscale
from timm_layerscale.errors import RemapError
from timm_layerscale.models.cait_ls import VARIANTS


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.full
def test_round_trip_every_variant_on_meta(name):
    ref = timm.create_model(str(VARIANTS[name].reference), device="meta").state_dict()
    ls = to_layerscale(ref, "cait")
    family = VARIANTS[name].family
    assert family.gates_in(ref)[1] and not family.gates_in(ls)[1]
    assert not any("gamma_" in k for k in ls)
    back = to_gamma(ls, "cait")
    assert list(back) == list(ref)
    assert all(back[k] is ref[k] for k in ref)
    ours = timm.create_model(name, device="meta").state_dict()
    check_state_dict(ls, ours, name)


def test_round_trip_real_tensors_bit_for_bit():
    torch.manual_seed(0)
    ref = timm.create_model("cait_xxs24_224", img_size=32, depth=2).state_dict()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        sd = {k: v.to(dtype) for k, v in ref.items()}
        back = to_gamma(to_layerscale(sd, "cait"), "cait")
        assert back.keys() == sd.keys()
        for k in sd:
            assert back[k].dtype == dtype and torch.equal(back[k], sd[k])


def test_prefixes_and_wrappers():
    inner = {"module._orig_mod.blocks.0.gamma_1": 1, "module.pos_embed": 2}
    assert strip_prefixes(inner) == {"blocks.0.gamma_1": 1, "pos_embed": 2}
    assert unwrap_state_dict({"model": inner, "epoch": 1}) is inner
    assert unwrap_state_dict({"state_dict": inner}) is inner
    ema = {"pos_embed": 5}
    assert unwrap_state_dict({"model": inner, "model_ema": ema}, "model_ema") is ema
    with pytest.raises(RemapError, match="model_ema"):
        unwrap_state_dict({"model_ema": ema, "epoch": 3})
    with pytest.raises(RemapError, match="no 'model_ema'"):
        unwrap_state_dict({"model": inner}, "model_ema")
    # timm's train.py keeps its EMA under 'state_dict_ema'.
    assert unwrap_state_dict({"state_dict": inner, "state_dict_ema": ema}, "model_ema") is ema
    assert unwrap_state_dict({"state_dict": inner, "state_dict_ema": ema}) is inner
    with pytest.raises(RemapError, match="only an EMA state dict \\('state_dict_ema'\\)"):
        unwrap_state_dict({"state_dict_ema": ema, "epoch": 3})
    assert to_layerscale(inner, "cait") == {"blocks.0.ls1.gamma": 1, "pos_embed": 2}


def test_unknown_keys_are_named():
    with pytest.raises(RemapError, match=r"2 key\(s\).*fc\.weight.*layer1\.0\.conv1\.weight"):
        to_layerscale({"fc.weight": 1, "layer1.0.conv1.weight": 2, "cls_token": 3}, "cait")


def test_mixed_layouts_rejected():
    with pytest.raises(RemapError, match="mixes"):
        to_layerscale({"blocks.0.gamma_1": 1, "blocks.1.ls1.gamma": 2}, "cait")


def test_the_name_of_a_module_wrapping_the_model_is_removed():
    model = {"cls_token": 1, "patch_embed.proj.weight": 2, "blocks.0.gamma_1": 3}
    assert strip_prefixes({"net." + k: v for k, v in model.items()}) == model
    assert strip_prefixes({"module.model." + k: v for k, v in model.items()}) == model
    # not where a key lies outside it, nor without the patch embedding that marks it
    beside = {"model." + k: v for k, v in model.items()} | {"criterion.weight": 4}
    assert strip_prefixes(beside) == beside
    assert strip_prefixes({"blocks.0.gamma_1": 1, "blocks.0.gamma_2": 2}) == {
        "blocks.0.gamma_1": 1,
        "blocks.0.gamma_2": 2,
    }


def test_a_dino_training_checkpoints_backbone_and_block_chunks_are_read():
    """``backbone.`` is removed beside the objective's heads (the family's rules drop those by name), and DINOv2's
    ``blocks.K.N.`` read as ``blocks.N.``."""
    model = {"cls_token": 1, "patch_embed.proj.weight": 2, "blocks.0.0.norm1.weight": 3, "blocks.1.1.norm1.weight": 4}
    heads = {"dino_head.mlp.0.weight": 5}
    got = state_dict_of({"teacher": {"backbone." + k: v for k, v in model.items()} | heads})
    unchunked = {"blocks.0.norm1.weight": 3, "blocks.1.norm1.weight": 4}
    assert got == {"cls_token": 1, "patch_embed.proj.weight": 2, **unchunked, **heads}


def test_colliding_prefixes_rejected():
    with pytest.raises(RemapError, match="ambiguous"):
        strip_prefixes({"module.cls_token": 1, "cls_token": 2})


def test_mismatch_report_lists_missing_unexpected_misshaped():
    expected = {f"w{i}": (2, 2) for i in range(8)}
    sd = {f"w{i}": torch.zeros(2, 2) for i in range(1, 8)}  # w0 missing
    sd["w3"] = torch.zeros(3, 2)
    sd["extra"] = torch.zeros(4)
    with pytest.raises(RemapError) as e:
        check_state_dict(sd, expected, "toy")
    msg = str(e.value)
    assert "toy" in msg and "\n" not in msg
    assert "1 missing (w0 [2, 2])" in msg
    assert "1 unexpected (extra [4])" in msg
    assert "1 mis-shaped (w3 [3, 2] != [2, 2])" in msg
    many = {f"m{i}": (1,) for i in range(9)}
    with pytest.raises(RemapError, match=r"9 missing \(.*, \.\.\.\)"):
        check_state_dict({}, many)


_SUFFIXES = st.sampled_from(
    ["gamma_1", "gamma_2", "norm1.weight", "norm2.bias", "attn.proj.weight", "mlp.fc1.bias", "mlp.fc2.weight"]
)
_TOKEN_SUFFIXES = st.sampled_from(["gamma_1", "gamma_2", "attn.q.weight", "attn.v.bias", "norm1.weight"])


def test_only_weights_must_be_floating_point():
    """A batch norm's counter ``num_batches_tracked`` is a 0-dim int64 in every model that has one; a weight stored
    as integers is refused by name."""
    from timm_layerscale.conversion.rules import check_floating

    check_floating({"bn.weight": torch.ones(2), "bn.num_batches_tracked": torch.tensor(7)})
    with pytest.raises(RemapError, match=r"1 tensor\(s\) not floating point \(fc\.weight is int8\)"):
        check_floating({"fc.weight": torch.ones(2, 2, dtype=torch.int8), "bn.num_batches_tracked": torch.tensor(7)})
