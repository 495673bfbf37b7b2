"""BEiT and BEiT v2 with LayerScale modules (``blocks.N.ls1.gamma`` / ``ls2.gamma``).

Papers: Bao et al., "BEiT: BERT Pre-Training of Image Transformers", ICLR 2022, arXiv 2106.08254; Peng et al.,
"BEiT v2: Masked Image Modeling with Vector-Quantized Visual Tokenizers", arXiv 2208.06366

timm's ``Beit`` as its ``beit_*``/``beitv2_*`` build it (each block's relative position bias included), its blocks
turned into blocks whose gates are LayerScale modules instead of raw ``gamma_1`` / ``gamma_2``; every pretrained tag
of the twin is registered and remapped as it loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn as nn
from timm.models import generate_default_cfgs
from timm.models.beit import Beit, Block
from timm.models.beit import checkpoint_filter_fn as timm_filter

from ..conversion.checkpoint import state_dict_of
from ..conversion.fold import fold_state_dict
from ..conversion.rules import to_layerscale
from ..families import Gate, Variant, beit, variants_of
from ._helpers import GatedBlock, LayerScaleModel, build_variant, register_variants, twin_cfgs

__all__ = ["BeitLS", "LayerScaleBeitBlock"]


class LayerScaleBeitBlock(GatedBlock, Block):
    """timm's BEiT ``Block`` with LayerScale modules ``ls1`` / ``ls2`` where it has ``gamma_1`` / ``gamma_2``
    (``nn.Identity`` without them); ``promote=True``, so under autocast the product promotes as timm's does."""

    GATES: ClassVar[tuple[Gate, ...]] = beit.GATES
    if TYPE_CHECKING:  # annotations TorchScript would try to resolve
        ls1: nn.Module
        ls2: nn.Module

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), shared_rel_pos_bias=shared_rel_pos_bias)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class BeitLS(LayerScaleModel, Beit):
    """timm's ``Beit`` whose blocks are :class:`LayerScaleBeitBlock` s.

    Args:
        folded_layerscale: Build without LayerScale modules; pretrained weights are folded as they load.
        **kwargs: timm's ``Beit`` arguments.
    """

    def __init__(self, folded_layerscale: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            LayerScaleBeitBlock.from_block(block, cast(Block, block).init_values, folded_layerscale)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: BeitLS) -> dict[str, torch.Tensor]:
    """Any BEiT checkpoint as this model's state dict: what timm's ``beit_*`` read (the authors' files, timm's) through
    timm's own filter (tables resized to the model's grid), then the gates as LayerScale modules, folded for a
    ``folded_layerscale`` model.

    Raises:
        RemapError: A key no rule covers.
    """
    sd = to_layerscale(timm_filter(state_dict_of(state_dict), model), "beit")
    return fold_state_dict(sd) if model.folded_layerscale else sd


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("beit")
default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> BeitLS:
    """timm's ``build_model_with_cfg`` of a BEiT variant: its table row's arguments, then ``kwargs``."""
    return build_variant(BeitLS, checkpoint_filter_fn, v, pretrained, kwargs)


register_variants(__name__, VARIANTS, build)
