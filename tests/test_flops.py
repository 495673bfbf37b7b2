"""``flop_count`` (FlopCounterMode on the meta device) against the multiplications written out by hand."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch

from helpers import TINY_CAIT, TINY_VIT5
from timm_layerscale.models.cait_ls import CaitLS
from timm_layerscale.models.vit5 import Vit5


def cait_multiplies(img: int, patch: int, C: int, depth: int, H: int, classes: int, gates: bool = True) -> int:
    """The patch embedding, per self-attention block qkv, proj, ``q k^T``, ``attn v``, the two head mixes, the
    MLP and the gates; per class-attention block q and proj of one token, k and v of ``1 + N``, attention,
    the MLP of one token and its gates; the head."""
    N = (img // patch) ** 2
    block = N * C * 3 * C + N * C * C + 2 * N * N * C + 2 * N * N * H * H + 2 * N * C * 4 * C + gates * 2 * N * C
    n = N + 1
    class_block = 2 * C * C + 2 * n * C * C + 2 * n * C + 2 * C * 4 * C + gates * 2 * C
    return N * C * 3 * patch * patch + depth * block + 2 * class_block + C * classes


def vit5_multiplies(img: int, patch: int, C: int, depth: int, classes: int) -> int:
    N = (img // patch) ** 2
    n = 1 + N + 4
    block = n * C * 3 * C + n * C * C + 2 * n * n * C + 2 * n * C * 4 * C + 2 * n * C
    return N * C * 3 * patch * patch + depth * block + C * classes


@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "unfused_attn"])
def test_flop_count_is_the_multiplications_of_the_forward_pass(fused, fused_attn):
    fused_attn(fused)
    t, v = TINY_CAIT, TINY_VIT5
    expected = cait_multiplies(
        t["img_size"], t["patch_size"], t["embed_dim"], t["depth"], t["num_heads"], t["num_classes"]
    )
    folded = cait_multiplies(
        t["img_size"], t["patch_size"], t["embed_dim"], t["depth"], t["num_heads"], t["num_classes"], False
    )
    model = CaitLS(**TINY_CAIT)
    assert model.flop_count() == expected and model.flop_count(batch_size=3) == 3 * expected
    assert CaitLS(**TINY_CAIT, folded_layerscale=True).flop_count() == folded
    assert Vit5(**v).flop_count() == vit5_multiplies(
        v["img_size"], v["patch_size"], v["embed_dim"], v["depth"], v["num_classes"]
    )


def test_flop_count_of_a_registered_model():
    model: CaitLS = timm.create_model("cait_xxs24_224_ls", device="meta")  # type: ignore[assignment]
    assert model.flop_count() == cait_multiplies(224, 16, 192, 24, 4, 1000)


def test_flop_count_of_a_model_without_a_patch_embedding():
    """ConvNeXt has a stem, no ``patch_embed``: its input size is its pretrained config's; the count is timm's twin's
    plus each gate's one multiply per element of its stage's maps."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        ours: Any = timm.create_model("convnext_atto_ls")
        twin = timm.create_model("convnext_atto")
    with FlopCounterMode(display=False) as counter:
        twin(torch.empty(1, 3, 224, 224, device="meta"))
    gates = sum(
        n * side * side * dim for n, side, dim in zip((2, 2, 6, 2), (56, 28, 14, 7), (40, 80, 160, 320), strict=True)
    )
    assert ours.flop_count() == counter.get_total_flops() // 2 + gates
