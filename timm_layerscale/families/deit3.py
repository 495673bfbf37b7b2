"""DeiT III (arXiv 2204.07118): the official ``models_v2.py`` files keep raw ``gamma_1``/``gamma_2`` under
``{'model': ...}``; timm's own ``deit3_*`` already use LayerScale modules, so its layout is this family's ``ls``."""

from __future__ import annotations

from typing import Any, cast

from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import timm_model
from .vit import VIT, gates


def _timm(variant: Variant, folded: bool, args: dict[str, Any], filtered: bool = False) -> Any:
    """timm's ``deit3_*``, read strictly, or (``filtered``, an official file) through timm's filter; folded, without
    LayerScale (``init_values=0``: timm drops ``None``)."""
    from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

    def official(sd: dict[str, Any], model: Any) -> Any:
        return checkpoint_filter_fn(sd, cast(VisionTransformer, model), adapt_layer_scale=True)

    return timm_model(
        variant.name, {**args, **({"init_values": 0.0} if folded else {})}, official if filtered else None
    )


BIBTEX = """\
@inproceedings{touvron2022deit3,
  title     = {{DeiT III}: Revenge of the {ViT}},
  author    = {Touvron, Hugo and Cord, Matthieu and J{\\'e}gou, Herv{\\'e}},
  booktitle = {European Conference on Computer Vision (ECCV)},
  pages     = {516--533},
  publisher = {Springer},
  year      = {2022}
}"""

_KEEP = (
    Rule(r"cls_token|pos_embed", KEEP),
    Rule(r"(?:patch_embed\.proj|norm|head)" + LINEAR, KEEP),
    Rule(r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + LINEAR, KEEP),
)
GATES = gates("official")
LS, RAW, TO_RAW = gate_rules(VIT["blocks"], GATES, _KEEP, "official")
_LS = Layout("ls", LS, LS, _timm)

FAMILY = Family(
    "deit3",
    "DeiT-III",
    {
        "ls": _LS,
        "timm": _LS,
        "official": Layout(
            "official", RAW, TO_RAW, lambda v, folded, args: _timm(v, folded, args, filtered=True), wrapper="model"
        ),
    },
    full_title="DeiT III",
    description="a plain Vision Transformer whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    **VIT,
    gates=GATES,
)


def _variant(size: str, img: int, dim: int, depth: int, heads: int, patch: int = 16) -> Variant:
    name = f"deit3_{size}_patch{patch}_{img}"
    return Variant(name, FAMILY, name, img, dim, depth, heads, None, patch_size=patch)


#: timm's DeiT III architectures.
VARIANTS = (
    _variant("small", 224, 384, 12, 6),
    _variant("small", 384, 384, 12, 6),
    _variant("medium", 224, 512, 12, 8),
    _variant("base", 224, 768, 12, 12),
    _variant("base", 384, 768, 12, 12),
    _variant("large", 224, 1024, 24, 16),
    _variant("large", 384, 1024, 24, 16),
    _variant("huge", 224, 1280, 32, 16, patch=14),
)
register(FAMILY, VARIANTS)
