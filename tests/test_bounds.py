"""Every registered variant's real error is at most half its bound (the large ones slow); a 1% gate change exceeds it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from timm_layerscale.conversion.fold import fold_state_dict
from timm_layerscale.conversion.rules import to_gamma, to_layerscale, to_layout
from timm_layerscale.families import VARIANTS, Variant, get_family
from timm_layerscale.parity.inputs import seed_parameters_, seeded_inputs
from timm_layerscale.parity.references import build_reference, load_model
from timm_layerscale.parity.tolerance import TOKENS_FACTOR, folded_bound, independent_bound, library_bound

pytestmark = pytest.mark.full  # make test leaves this file to make test-full

SMALL = {"cait_xxs24_224_ls", "vit5_small_patch16_224", "deit3_small_patch16_224", "vit_small_patch16_dinov3_ls"}


def _error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """The smallest ``b`` with ``|ref - out| <= b + b * |ref|``: the bound a check with ``atol = rtol = b`` needs."""
    return float(((ref - out).abs() / (1 + ref.abs())).max())


def _attend(model: torch.nn.Module, fused: bool) -> torch.nn.Module:
    for m in (m for m in model.modules() if hasattr(m, "fused_attn")):
        setattr(m, "fused_attn", fused)  # noqa: B010
    return model


def _param(v: Variant) -> object:
    if v.embed_dim >= 4096:  # the 7B: two fp32 models are ~55 GB
        return pytest.param(v, marks=pytest.mark.skip(reason="needs ~55 GB for two fp32 copies"))
    return v if v.name in SMALL else pytest.param(v, marks=pytest.mark.slow)


@torch.no_grad()
@pytest.mark.parametrize("v", [_param(v) for v in VARIANTS], ids=lambda v: v.name)
def test_each_variants_error_is_at_most_half_its_bound(v: Variant) -> None:
    source = to_gamma(seed_parameters_(build_reference(v), seed=0).state_dict(), v.family)
    ls, x = to_layerscale(source, v.family), seeded_inputs(2, v.img_size)
    depth = v.depth + (2 if v.family.name == "cait" else 0)
    tokens = get_family(v.family).tokens
    run: Any = (lambda m: m.forward_features(x)) if tokens else (lambda m: m(x))  # as verification compares them
    scale = TOKENS_FACTOR if tokens else 1.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # a folded file against the rounded source
        ref = run(
            load_model(
                v, v.family.layout("gamma"), {k: t if k.endswith(".freqs") else t.to(dtype) for k, t in source.items()}
            )
        )
        folded = load_model(
            v, v.family.layout("ls"), {k: t.to(dtype) for k, t in fold_state_dict(ls).items()}, folded=True
        )
        out = run(_attend(folded, False) if v.family.name == "vit5" else folded)  # as verification runs them
        assert _error(ref, out) <= scale * folded_bound(depth, v.embed_dim, dtype) / 2, (dtype, _error(ref, out))
    if "transformers" in v.family.layouts:  # against transformers' model, with timm's attention fused and not
        theirs = run(load_model(v, v.family.layout("transformers"), to_layout(ls, v.family, "transformers")))
        for fused in (False, True):
            ref = run(_attend(load_model(v, v.family.layout("gamma"), source), fused))
            assert _error(ref, theirs) <= scale * library_bound(depth, v.embed_dim) / 2, (fused, _error(ref, theirs))
    if v.family.name != "vit5":
        return
    ref, bound = load_model(v, v.family.layout("gamma"), source)(x), independent_bound(depth, v.embed_dim)
    for fused in (False, True):  # as verification runs it, and with attention summed in another order
        assert _error(ref, _attend(load_model(v, v.family.layout("ls"), ls), fused)(x)) <= bound / 2, fused
    changed = dict(ls, **{"blocks.0.ls1.gamma": ls["blocks.0.ls1.gamma"].clone()})
    changed["blocks.0.ls1.gamma"][0] *= 1.01  # the mutation net's cast defect
    assert _error(ref, _attend(load_model(v, v.family.layout("ls"), changed), False)(x)) > bound
