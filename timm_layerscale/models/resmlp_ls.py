"""ResMLP with LayerScale modules (Touvron et al., TPAMI 2023, arXiv 2105.03404): timm's ``MlpMixer`` as its
``resmlp_*`` build it, the bare ``ls1``/``ls2`` of its blocks LayerScale modules; every tag of the twin registered and
remapped as it loads. It has no folded form (:data:`~timm_layerscale.families.resmlp.GATES`)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
from timm.models import generate_default_cfgs
from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
from timm.models.mlp_mixer import checkpoint_filter_fn as timm_filter

from ..conversion.checkpoint import state_dict_of
from ..conversion.rules import to_layerscale
from ..families import Gate, Variant, resmlp, variants_of
from ._helpers import GatedBlock, LayerScaleModel, build_variant, register_variants, twin_cfgs

__all__ = ["LayerScaleResBlock", "ResMlpLS"]


class LayerScaleResBlock(GatedBlock, ResBlock):
    """timm's ``ResBlock`` with LayerScale modules ``ls1`` / ``ls2`` where it has the bare parameters; ``ls1 * y`` and
    ``y * gamma`` are one product, so outputs are ``torch.equal`` to timm's."""

    GATES: ClassVar[tuple[Gate, ...]] = resmlp.GATES
    if TYPE_CHECKING:  # annotations TorchScript would try to resolve; timm's block holds Parameters there
        ls1: nn.Module  # type: ignore[assignment]
        ls2: nn.Module  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.linear_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)))
        return x + self.drop_path(self.ls2(self.mlp_channels(self.norm2(x))))


class ResMlpLS(LayerScaleModel, MlpMixer):
    """timm's ``MlpMixer`` (``**kwargs``) of ``depth`` :class:`LayerScaleResBlock` s with ``Affine`` norms, every
    gate at ``init_values``; ``num_heads`` is taken for the variant table and unused; ``folded_layerscale`` is a
    ``ValueError``."""

    def __init__(
        self,
        depth: int = 12,
        init_values: float = 1e-4,
        num_heads: int = 0,
        folded_layerscale: bool = False,
        **kwargs: Any,
    ) -> None:
        if folded_layerscale:
            raise ValueError(f"ResMLP has no folded form: {resmlp.GATES[0].no_fold}")
        block: Any = partial(ResBlock, init_values=init_values)
        super().__init__(num_blocks=depth, block_layer=block, norm_layer=Affine, **kwargs)
        for b in self.blocks:
            LayerScaleResBlock.from_block(b, init_values)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: ResMlpLS) -> dict[str, torch.Tensor]:
    """Any ResMLP checkpoint as this model's state dict: what timm's ``resmlp_*`` read (the authors' files, timm's)
    through timm's own filter, then the gates as LayerScale modules.

    Raises:
        RemapError: A key no rule covers.
    """
    return to_layerscale(timm_filter(state_dict_of(state_dict), model), "resmlp")


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("resmlp")
default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> ResMlpLS:
    """timm's ``build_model_with_cfg`` of a ResMLP variant: its table row's arguments, then ``kwargs``."""
    return build_variant(ResMlpLS, checkpoint_filter_fn, v, pretrained, kwargs)


register_variants(__name__, VARIANTS, build)
