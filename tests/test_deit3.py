"""DeiT-III: official ``deit_3_*.pth`` files (``gamma_1`` / ``gamma_2``) into timm's ``deit3_*`` (``ls1.gamma``)."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

import timm_layerscale  # noqa: F401
from timm_layerscale.conversion import checkpoint
from timm_layerscale.conversion import rules as remap
from timm_layerscale.errors import RemapError
from timm_layerscale.families import get_family, get_variant
from timm_layerscale.parity.references import build_reference, load_model, model_name

NAME = "deit3_small_patch16_224"


def seeded_deit3(name: str = NAME, seed: int = 0, **kwargs) -> torch.nn.Module:
    """timm's DeiT-III with every parameter random (gammas ~ N(0, 0.1), norms ~ 1 + N(0, 0.1))."""
    model = timm.create_model(name, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("gamma"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2 and key not in ("cls_token", "pos_embed"):
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif key.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def official_file(tmp_path, model: torch.nn.Module) -> str:
    """The model's weights as the official ``deit_3_*.pth``: ``{'model': state_dict}`` in the gamma layout."""
    path = tmp_path / "deit_3_small_224_1k.pth"
    torch.save({"model": remap.to_gamma(model.state_dict(), "deit3")}, path)
    return str(path)


def images(n: int = 4, size: int = 224, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def deit3_small() -> torch.nn.Module:
    return seeded_deit3()


def test_official_keys(deit3_small) -> None:
    official = remap.to_gamma(deit3_small.state_dict(), "deit3")
    block = sorted(k.split(".", 2)[2] for k in official if k.startswith("blocks.0."))
    layers = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
    assert block == sorted(["gamma_1", "gamma_2", *(f"{m}.{p}" for m in layers for p in ("weight", "bias"))])
    top = sorted(k for k in official if not k.startswith("blocks."))
    outer = ("patch_embed.proj", "norm", "head")
    assert top == sorted(["cls_token", "pos_embed", *(f"{m}.{p}" for m in outer for p in ("weight", "bias"))])
    assert official["pos_embed"].shape == (1, 196, 384)  # no class-token slot


@pytest.mark.compat
def test_converted_file_matches_timm_loader_bit_for_bit(tmp_path, deit3_small) -> None:
    path = official_file(tmp_path, deit3_small)
    # timm's own loader on the official file
    via_timm = timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=path)).eval()
    # this package's rules on the same file
    raw = torch.load(path, map_location="cpu", weights_only=True)
    converted = remap.to_layerscale(checkpoint.unwrap_state_dict(raw), "deit3")
    ours = timm.create_model(NAME)
    ours.load_state_dict(converted, strict=True)
    ours.eval()
    # and the converted file, loaded by timm
    out_path = tmp_path / "deit3_small.safetensors"
    save_file({k: v.contiguous() for k, v in converted.items()}, str(out_path))
    from_file = timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(out_path))).eval()
    x = images(2)
    with torch.no_grad():
        expected = via_timm(x)
        assert torch.equal(ours(x), expected)
        assert torch.equal(from_file(x), expected)
        assert torch.equal(expected, deit3_small(x))
    print(f"deit3_small_patch16_224: max abs diff 0 (bit-exact), top-1 agreement 100%, over {x.shape[0]} inputs")


@pytest.mark.compat
def test_round_trip_keeps_tensors(deit3_small) -> None:
    ls = deit3_small.state_dict()
    official = remap.to_gamma(ls, "deit3")
    assert "blocks.11.gamma_2" in official and not any(".ls" in k for k in official)
    back = remap.to_layerscale(official, "deit3")
    assert list(back) == list(ls)
    assert all(back[k] is ls[k] for k in ls)
    again = remap.to_gamma(back, "deit3")
    assert list(again) == list(official) and all(again[k] is official[k] for k in official)
    assert get_family("deit3").gates_in(official)[1]


def test_ddp_prefix_and_unknown_keys(deit3_small) -> None:
    official = remap.to_gamma(deit3_small.state_dict(), "deit3")
    prefixed = {"module." + k: v for k, v in official.items()}
    assert remap.to_layerscale(prefixed, "deit3").keys() == deit3_small.state_dict().keys()
    with pytest.raises(RemapError, match=r"blocks\.0\.gamma_1_1"):
        remap.to_layerscale(dict(official, **{"blocks.0.gamma_1_1": official["blocks.0.gamma_1"]}), "deit3")
    with pytest.raises(RemapError, match="reg_token"):
        remap.to_layerscale(dict(official, reg_token=torch.zeros(1, 4, 384)), "deit3")


def test_reference_interface(deit3_small) -> None:
    loaded = load_model(
        get_variant(NAME), get_family("deit3").layout("gamma"), remap.to_gamma(deit3_small.state_dict(), "deit3")
    )  # through timm's filter
    assert (
        model_name(get_variant(NAME), get_family("deit3").layouts["official"]) == NAME
        and not loaded.training
        and build_reference(get_variant(NAME)).training
    )
    x = images(2)
    with torch.no_grad():
        assert torch.equal(loaded(x), deit3_small(x))
