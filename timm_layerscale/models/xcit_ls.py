"""XCiT with LayerScale modules (El-Nouby et al., NeurIPS 2021, arXiv 2106.09681): timm's ``Xcit`` as its ``xcit_*``
build it, the raw ``gamma1``/``gamma2``/``gamma3`` of its blocks LayerScale modules; every tag of the twin registered
and remapped as it loads. It has no folded form (:data:`~timm_layerscale.families.xcit.CLASS_GATES`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
from timm.models import generate_default_cfgs
from timm.models.xcit import ClassAttentionBlock, XCABlock, Xcit
from timm.models.xcit import checkpoint_filter_fn as timm_filter

from ..conversion.checkpoint import state_dict_of
from ..conversion.rules import to_layerscale
from ..families import Gate, Variant, variants_of, xcit
from ._helpers import GatedBlock, LayerScaleModel, build_variant, register_variants, twin_cfgs

__all__ = ["LayerScaleClassAttentionBlock", "LayerScaleXCABlock", "XcitLS"]


class LayerScaleXCABlock(GatedBlock, XCABlock):
    """timm's ``XCABlock`` with LayerScale modules ``ls1`` (attention), ``ls3`` (local patch interaction) and ``ls2``
    (MLP) where it has ``gamma1`` / ``gamma3`` / ``gamma2``; ``gamma * y`` and ``y * gamma`` are one product, so outputs
    are ``torch.equal`` to timm's."""

    GATES: ClassVar[tuple[Gate, ...]] = xcit.XCA_GATES
    if TYPE_CHECKING:  # annotations TorchScript would try to resolve
        ls1: nn.Module
        ls2: nn.Module
        ls3: nn.Module

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path3(self.ls3(self.local_mp(self.norm3(x), H, W)))  # 3 before 2, as the authors' order
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class LayerScaleClassAttentionBlock(GatedBlock, ClassAttentionBlock):
    """timm's XCiT ``ClassAttentionBlock`` with LayerScale modules: ``ls1`` scales the attended class token and the
    normed patch tokens together, ``ls2`` the class token's MLP output."""

    GATES: ClassVar[tuple[Gate, ...]] = xcit.CLASS_GATES
    if TYPE_CHECKING:  # annotations TorchScript would try to resolve
        ls1: nn.Module
        ls2: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_norm1 = self.norm1(x)
        x = x + self.drop_path1(self.ls1(torch.cat([self.attn(x_norm1), x_norm1[:, 1:]], dim=1)))
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, 0:1]), x[:, 1:]], dim=1)
        cls_token = self.ls2(self.mlp(x[:, 0:1]))
        return x + self.drop_path2(torch.cat([cls_token, x[:, 1:]], dim=1))


class XcitLS(LayerScaleModel, Xcit):
    """timm's ``Xcit`` (``**kwargs``) whose blocks are :class:`LayerScaleXCABlock` s and
    :class:`LayerScaleClassAttentionBlock` s, every gate at ``init_values`` (timm's ``eta``); ``folded_layerscale``
    is a ``ValueError``."""

    def __init__(self, init_values: float = 1.0, folded_layerscale: bool = False, **kwargs: Any) -> None:
        if folded_layerscale:
            raise ValueError(f"XCiT has no folded form: {xcit.CLASS_GATES[0].no_fold}")
        super().__init__(eta=init_values, **kwargs)
        for block in self.blocks:
            LayerScaleXCABlock.from_block(block, init_values)
        for block in self.cls_attn_blocks:
            LayerScaleClassAttentionBlock.from_block(block, init_values)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: XcitLS) -> dict[str, torch.Tensor]:
    """Any XCiT checkpoint as this model's state dict: what timm's ``xcit_*`` read (the authors' files, timm's)
    through timm's own filter, then the gates as LayerScale modules.

    Raises:
        RemapError: A key no rule covers.
    """
    return to_layerscale(timm_filter(dict(state_dict_of(state_dict)), model), "xcit")


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("xcit")
default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> XcitLS:
    """timm's ``build_model_with_cfg`` of an XCiT variant: its table row's arguments, then ``kwargs``."""
    return build_variant(XcitLS, checkpoint_filter_fn, v, pretrained, kwargs)


register_variants(__name__, VARIANTS, build)
