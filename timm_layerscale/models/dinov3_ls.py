"""DINOv3 with LayerScale modules (``ls1.gamma`` / ``ls2.gamma``), the layout of timm's ViT and DeiT-III.

Paper: Siméoni et al., "DINOv3", arXiv 2508.10104, https://arxiv.org/abs/2508.10104

timm's ``Eva`` as its ``vit_*_patch16_dinov3[_qkvb]`` build it, its ``EvaBlock`` s turned into blocks whose gates
are LayerScale modules instead of raw ``gamma_1`` / ``gamma_2``, so the model stays timm's class; timm's Hub weights
(``lvd1689m``, ``sat493m``, ``eupe_lvd1689m``) remapped as they load. Weights from Meta remain under the DINOv3
License, EUPE's under FAIR's non-commercial research licence.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn as nn
from timm.layers import LayerNorm
from timm.models import generate_default_cfgs
from timm.models.eva import Eva, EvaBlock

from ..conversion.checkpoint import state_dict_of
from ..conversion.rules import to_layerscale, without_zero_optional
from ..families import Gate, Variant, dinov3, variants_of
from ._helpers import GatedBlock, LayerScaleModel, build_variant, fit_state_dict, register_variants, twin_cfgs

__all__ = ["DinoV3LS", "LayerScaleEvaBlock"]


class LayerScaleEvaBlock(GatedBlock, EvaBlock):
    """timm's ``EvaBlock`` with LayerScale modules ``ls1`` / ``ls2`` where it has ``gamma_1`` / ``gamma_2``
    (``nn.Identity`` without them). ``promote=True``: under autocast the product with the fp32 gate promotes,
    as timm's raw-parameter product does, so outputs are ``torch.equal`` to timm's."""

    GATES: ClassVar[tuple[Gate, ...]] = dinov3.GATES
    if TYPE_CHECKING:  # annotations TorchScript would try to resolve
        ls1: nn.Module
        ls2: nn.Module

    # EvaBlock's own signature, which TorchScript needs spelled out (newer timm passes is_causal)
    if TYPE_CHECKING or "is_causal" in inspect.signature(EvaBlock.forward).parameters:

        def forward(
            self,
            x: torch.Tensor,
            rope: torch.Tensor | None = None,
            attn_mask: torch.Tensor | None = None,
            is_causal: bool = False,
        ) -> torch.Tensor:
            x = x + self.drop_path1(
                self.ls1(self.attn(self.norm1(x), rope=rope, attn_mask=attn_mask, is_causal=is_causal))
            )
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    else:

        def forward(
            self, x: torch.Tensor, rope: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
        ) -> torch.Tensor:
            x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope=rope, attn_mask=attn_mask)))
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class DinoV3LS(LayerScaleModel, Eva):
    """timm's ``Eva`` (DINOv3 settings) whose blocks are :class:`LayerScaleEvaBlock` s.

    Args:
        folded_layerscale: Build without LayerScale modules; pretrained weights are folded as they load.
        **kwargs: timm's ``Eva`` arguments.
    """

    def __init__(self, folded_layerscale: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            LayerScaleEvaBlock.from_block(block, cast(EvaBlock, block).init_values, folded_layerscale)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: DinoV3LS) -> dict[str, torch.Tensor]:
    """A DINOv3 checkpoint in any layout (official, timm's ``gamma_1``, this model's, transformers') as this model's
    state dict: zero q and v biases left out for a model without them, the gates folded for a ``folded_layerscale``
    model.

    Raises:
        RemapError: A key no rule covers, or non-zero biases for a model without them.
    """
    sd = to_layerscale(state_dict_of(state_dict), "dinov3")
    name = getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)
    return fit_state_dict(without_zero_optional(sd, dinov3.FAMILY, model.state_dict(), name), model)


#: What every DINOv3 shares (timm's ``vit_*_dinov3``): rotary positions, four registers, no absolute positions.
DINOV3_ARGS = dict(
    dynamic_img_size=True,
    rope_type="dinov3",
    rope_temperature=100,
    rope_rotate_half=True,
    use_rot_pos_emb=True,
    use_abs_pos_emb=False,
    num_reg_tokens=4,
    use_fc_norm=False,
    norm_layer=partial(LayerNorm, eps=1e-5),
)

#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("dinov3")


default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> DinoV3LS:
    """timm's ``build_model_with_cfg`` of a DINOv3 variant: the shared arguments, its table row's, then ``kwargs``."""
    return build_variant(DinoV3LS, checkpoint_filter_fn, v, pretrained, {**DINOV3_ARGS, **kwargs})


register_variants(__name__, VARIANTS, build)
