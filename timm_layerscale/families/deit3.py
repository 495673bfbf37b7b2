"""DeiT III (arXiv 2204.07118): the official ``models_v2.py`` files keep raw ``gamma_1``/``gamma_2``; timm's own
``deit3_*`` already use LayerScale modules, so its models are this family's."""

from __future__ import annotations

from typing import Any, cast

from . import KEEP, LINEAR, Family, Rule, Variant, layerscale_rules, register


def _variant(size: str, img: int, dim: int, depth: int, heads: int, patch: int = 16) -> Variant:
    name = f"deit3_{size}_patch{patch}_{img}"
    return Variant(name, "deit3", name, img, dim, depth, heads, None, patch_size=patch)


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


def native(variant: Variant, layout: str, folded: bool, args: dict[str, Any]) -> Any:
    """Timm's ``deit3_*`` through its filter; folded, without LayerScale (``init_values=0``: timm drops ``None``)."""
    import timm
    from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

    kwargs = {**args, **({"init_values": 0.0} if folded else {})}
    return lambda: timm.create_model(variant.name, **kwargs), lambda sd, model: checkpoint_filter_fn(
        sd, cast(VisionTransformer, model), adapt_layer_scale=True
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

FAMILY = Family(
    "deit3",
    "DeiT-III",
    *layerscale_rules(r"blocks", _KEEP),
    native=native,
    full_title="DeiT III",
    description="a plain Vision Transformer whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
)
register(FAMILY, VARIANTS)
