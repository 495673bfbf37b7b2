"""CaiT (arXiv 2103.17239): the official ``cait_models.py`` and timm's ``cait_*`` keep raw ``gamma_1``/``gamma_2``,
this package's ``cait_*_ls`` (:mod:`timm_layerscale.models.cait_ls`) LayerScale modules; official files are from DDP."""

from __future__ import annotations

from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model
from .vit import VIT, gates

#: Where the official checkpoints are published (``+ Variant.official_file``).
RELEASE_URL = "https://dl.fbaipublicfiles.com/deit/"


BIBTEX = """\
@inproceedings{touvron2021cait,
  title     = {Going Deeper With Image Transformers},
  author    = {Touvron, Hugo and Cord, Matthieu and Sablayrolles, Alexandre and Synnaeve, Gabriel and J{\\'e}gou, Herv{\\'e}},
  booktitle = {Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
  pages     = {32--42},
  year      = {2021}
}"""

_BLOCK = r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|attn\.proj_l|attn\.proj_w|mlp\.fc1|mlp\.fc2)"
_CLASS_BLOCK = r"blocks_token_only\.\d+\.(?:norm1|norm2|attn\.q|attn\.k|attn\.v|attn\.proj|mlp\.fc1|mlp\.fc2)"
_KEEP = (
    Rule(r"cls_token|pos_embed", KEEP),
    Rule(r"(?:patch_embed\.proj|norm|head)" + LINEAR, KEEP),
    Rule(_BLOCK + LINEAR, KEEP),
    Rule(_CLASS_BLOCK + LINEAR, KEEP),
)


_BLOCKS = r"blocks(?:_token_only)?\.\d+"
GATES = gates("timm", "official")
LS, RAW, TO_RAW = gate_rules(_BLOCKS, GATES, _KEEP)
FAMILY = Family(
    "cait",
    "CaiT",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout("official", RAW, TO_RAW, timm_filtered("cait"), wrapper="model", prefix="module."),
    },
    extra_blocks=2,
    full_title="CaiT (Class-Attention in Image Transformers)",
    description="a stack of self-attention blocks with talking-heads attention, then two class-attention blocks in "
    "which only the class token attends to the patch tokens; every residual branch is scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    **{**VIT, "blocks": _BLOCKS},
    gates=GATES,
    class_stage="blocks_token_only",
)


def _variant(size: str, img: int, dim: int, depth: int, heads: int, init: float) -> Variant:
    ref = f"cait_{size}{depth}_{img}"
    return Variant(
        f"{ref}_ls", FAMILY, ref, img, dim, depth, heads, init, official_file=f"{size.upper()}{depth}_{img}.pth"
    )


#: The ten released variants.
VARIANTS = (
    _variant("xxs", 224, 192, 24, 4, 1e-5),
    _variant("xxs", 384, 192, 24, 4, 1e-5),
    _variant("xxs", 224, 192, 36, 4, 1e-5),
    _variant("xxs", 384, 192, 36, 4, 1e-5),
    _variant("xs", 384, 288, 24, 6, 1e-5),
    _variant("s", 224, 384, 24, 8, 1e-5),
    _variant("s", 384, 384, 24, 8, 1e-5),
    _variant("s", 384, 384, 36, 8, 1e-6),
    _variant("m", 384, 768, 36, 16, 1e-6),
    _variant("m", 448, 768, 48, 16, 1e-6),
)


register(FAMILY, VARIANTS)
