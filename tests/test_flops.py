"""``flop_count`` agrees with ``torch.utils.flop_counter`` within 1%."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from helpers import TINY_CAIT
from timm_layerscale.models.cait_ls import CaitLS

# --- FLOP counts ---------------------------------------------------------------------


def _counted_multiplies(model: nn.Module, size: int) -> float:
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, size, size))
    return counter.get_total_flops() / 2


@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "unfused_attn"])
def test_flop_count_matches_flop_counter_tiny(fused, fused_attn):
    fused_attn(fused)
    for kwargs in ({}, dict(folded_layerscale=True), dict(global_pool="avg", depth_token_only=1)):
        model = CaitLS(**TINY_CAIT, **kwargs).eval()
        ours, counted = model.flop_count(), _counted_multiplies(model, 32)
        assert abs(ours - counted) / counted < 0.01, (kwargs, ours, counted)
        assert model.flop_count(batch_size=3) == 3 * ours


def test_flop_count_matches_flop_counter_xxs24(pairs):
    model = pairs("cait_xxs24_224")[1]
    ours, counted = model.flop_count(), _counted_multiplies(model, 224)
    assert abs(ours - counted) / counted < 0.01, (ours, counted)


def test_flop_count_of_fused_model_drops_layerscale():
    patches, dim = (32 // 8) ** 2, TINY_CAIT["embed_dim"]
    layerscale = 2 * dim * (TINY_CAIT["depth"] * patches + 2 * 1)  # two per block; class blocks see 1 token
    unfolded = CaitLS(**TINY_CAIT).flop_count()
    assert CaitLS(**TINY_CAIT, folded_layerscale=True).flop_count() == unfolded - layerscale
