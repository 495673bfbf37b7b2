"""ConvNeXt with a LayerScale module in each block (``stages.S.blocks.B.ls.gamma``).

Paper: Liu et al., "A ConvNet for the 2020s", CVPR 2022, arXiv 2201.03545, https://arxiv.org/abs/2201.03545

timm's ``ConvNeXt`` as its ``convnext_*`` build it, its ``ConvNeXtBlock`` s turned into blocks whose gate is a
LayerScale module instead of the raw ``gamma``, so the model stays timm's class (stages, ``forward_intermediates``,
``features_only``); every pretrained tag of the twin is registered and remapped as it loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn as nn
from timm.models import build_model_with_cfg, generate_default_cfgs
from timm.models.convnext import ConvNeXt, ConvNeXtBlock
from timm.models.convnext import checkpoint_filter_fn as timm_filter

from ..conversion.checkpoint import state_dict_of
from ..conversion.fold import fold_state_dict
from ..conversion.rules import to_layerscale
from ..families import Gate, Variant, convnext, variants_of
from ._helpers import GatedBlock, LayerScaleModel, register_variants, twin_cfgs

__all__ = ["ConvNeXtLS", "LayerScaleConvNeXtBlock"]


class LayerScaleConvNeXtBlock(GatedBlock, ConvNeXtBlock):
    """timm's ``ConvNeXtBlock`` with a LayerScale module ``ls`` where it has ``gamma`` (``nn.Identity`` without).

    The gate scales the channels-last view of the branch's output (``(B, H, W, C)``, the last dimension its
    channels): one multiply per element, with timm's type promotion under autocast (``promote=True``), into a tensor of
    the memory format timm's ``x.mul(gamma.reshape(1, -1, 1, 1))`` gives, so the residual sum and the next blocks run
    the same kernels and outputs are ``torch.equal`` to timm's."""

    GATES: ClassVar[tuple[Gate, ...]] = convnext.GATES
    if TYPE_CHECKING:  # an annotation TorchScript would try to resolve
        ls: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x)
        if self.use_conv_mlp:
            x = self.ls(self.mlp(self.norm(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        else:
            x = self.ls(self.mlp(self.norm(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)
        return self.drop_path(x) + self.shortcut(shortcut)


class ConvNeXtLS(LayerScaleModel, ConvNeXt):
    """timm's ``ConvNeXt`` whose blocks are :class:`LayerScaleConvNeXtBlock` s.

    Args:
        folded_layerscale: Build without LayerScale modules; pretrained weights are folded as they load.
        **kwargs: timm's ``ConvNeXt`` arguments.
    """

    def __init__(self, folded_layerscale: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        init_value = kwargs.get("ls_init_value", 1e-6)
        for stage in self.stages:
            for block in cast(nn.Sequential, stage.blocks):
                LayerScaleConvNeXtBlock.from_block(block, init_value, folded_layerscale)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: ConvNeXtLS) -> dict[str, torch.Tensor]:
    """Any ConvNeXt checkpoint as this model's state dict: what timm's ``convnext_*`` read (the authors' files,
    open_clip towers, timm's) through timm's own filter, then the gate as a LayerScale module, folded for a
    ``folded_layerscale`` model.

    Raises:
        RemapError: A key no rule covers.
    """
    sd = to_layerscale(timm_filter(state_dict_of(state_dict), model), "convnext")
    return fold_state_dict(sd, convnext.FAMILY) if model.folded_layerscale else sd


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("convnext")
default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> ConvNeXtLS:
    """timm's ``build_model_with_cfg`` of a ConvNeXt variant: its table row's ``ConvNeXt`` arguments, then ``kwargs``,
    with the feature settings of timm's ``convnext_*``."""
    feature_cfg = {"out_indices": (0, 1, 2, 3), "flatten_sequential": True}
    return build_model_with_cfg(
        ConvNeXtLS,
        v.name,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=feature_cfg,
        **{**dict(v.args), **kwargs},
    )


register_variants(__name__, VARIANTS, build)
