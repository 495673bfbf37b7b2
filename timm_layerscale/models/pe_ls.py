"""Perception Encoder with LayerScale modules (``ls1.gamma`` / ``ls2.gamma``).

Paper: Bolya et al., "Perception Encoder: The best visual embeddings are not at the output of the network",
arXiv 2504.13181, https://arxiv.org/abs/2504.13181

timm's ``Eva`` as its ``vit_pe_lang_*`` and ``vit_pe_spatial_gigantic`` build it, its blocks'
raw ``gamma_1`` / ``gamma_2`` turned into LayerScale modules as DINOv3's are (:class:`~.dinov3_ls.DinoV3LS`), so
outputs are timm's bit for bit; timm's Hub weights (``fb``) remapped as they load.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from timm.layers import LayerNorm
from timm.models import generate_default_cfgs

from ..conversion.checkpoint import state_dict_of
from ..conversion.rules import to_layerscale
from ..families import Variant, variants_of
from ._helpers import build_variant, fit_state_dict, register_variants, twin_cfgs
from .dinov3_ls import DinoV3LS

__all__ = ["PE_ARGS"]


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: DinoV3LS) -> dict[str, torch.Tensor]:
    """A Perception Encoder checkpoint in any layout (the authors', timm's ``gamma_1``, this model's) as this
    model's state dict, the gates folded for a ``folded_layerscale`` model."""
    return fit_state_dict(to_layerscale(state_dict_of(state_dict), "pe"), model)


#: What timm's ``vit_pe_*`` with LayerScale share: rotary positions on a 32 x 32 reference grid, a norm before the
#: blocks and none after.
PE_ARGS = dict(
    attn_type="rope",
    use_rot_pos_emb=True,
    ref_feat_shape=(32, 32),
    rope_grid_indexing="xy",
    use_pre_transformer_norm=True,
    use_post_transformer_norm=False,
    use_fc_norm=False,
    norm_layer=partial(LayerNorm, eps=1e-5),
)
#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("pe")
default_cfgs = generate_default_cfgs(twin_cfgs(VARIANTS))


def build(v: Variant, pretrained: bool, kwargs: dict[str, Any]) -> DinoV3LS:
    """timm's ``build_model_with_cfg`` of a Perception Encoder variant: the shared arguments, its row's, ``kwargs``."""
    return build_variant(DinoV3LS, checkpoint_filter_fn, v, pretrained, {**PE_ARGS, **kwargs})


register_variants(__name__, VARIANTS, build)
