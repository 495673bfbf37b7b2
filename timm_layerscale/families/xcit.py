"""XCiT (arXiv 2106.09681): the authors' files (facebookresearch/xcit, ``{'model': ...}``) and timm's ``xcit_*`` keep
raw ``gamma1``/``gamma2``/``gamma3``; the authors name the positional encoding ``pos_embeder`` and fuse the
class-attention ``qkv``, which timm splits into ``q``/``k``/``v``; this package's ``xcit_*_ls``
(:mod:`timm_layerscale.models.xcit_ls`) holds LayerScale modules ``ls1``/``ls3``/``ls2``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import KEEP, LINEAR, Family, Gate, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model
from .operations import split_qkv

XCA_BLOCK = r"blocks\.\d+"
CLASS_BLOCK = r"cls_attn_blocks\.\d+"
#: The gates of a class-attention block (``ls1`` scales the attended class token and the normed patch tokens).
CLASS_GATES = (
    Gate(
        "ls1",
        "attention",
        {"timm": "gamma1", "official": "gamma1"},
        no_fold="XCiT's class-attention ls1 scales the normed patch tokens beside the attention output, and no "
        "layer produces those",
        blocks=CLASS_BLOCK,
    ),
    Gate("ls2", "MLP", {"timm": "gamma2", "official": "gamma2"}, fold="mlp.fc2", blocks=CLASS_BLOCK),
)
#: The gates of an XCA block, on its attention, its local patch interaction and its MLP.
XCA_GATES = (
    Gate("ls1", "attention", {"timm": "gamma1", "official": "gamma1"}, fold="attn.proj", blocks=XCA_BLOCK),
    Gate(
        "ls3",
        "local patch interaction",
        {"timm": "gamma3", "official": "gamma3"},
        fold="local_mp.conv2",
        blocks=XCA_BLOCK,
    ),
    Gate("ls2", "MLP", {"timm": "gamma2", "official": "gamma2"}, fold="mlp.fc2", blocks=XCA_BLOCK),
)
ANY_BLOCK = r"(?:cls_attn_)?blocks\.\d+"
BATCH_NORM = r"\.(?:weight|bias|running_mean|running_var|num_batches_tracked)"
_SHARED = (
    Rule(r"cls_token", KEEP),
    Rule(r"patch_embed\.proj\.\d+\.0\.weight|patch_embed\.proj\.\d+\.1" + BATCH_NORM, KEEP),
    Rule(r"(?:norm|head)" + LINEAR, KEEP),
    Rule(rf"{XCA_BLOCK}\.(?:norm[123]|attn\.qkv|attn\.proj|local_mp\.conv[12]|mlp\.fc[12])" + LINEAR, KEEP),
    Rule(rf"{XCA_BLOCK}\.attn\.temperature|{XCA_BLOCK}\.local_mp\.bn" + BATCH_NORM, KEEP),
    Rule(rf"{CLASS_BLOCK}\.(?:norm[12]|attn\.proj|mlp\.fc[12])" + LINEAR, KEEP),
)
_TIMM = (Rule(r"pos_embed\.token_projection" + LINEAR, KEEP), Rule(rf"{CLASS_BLOCK}\.attn\.[qkv]" + LINEAR, KEEP))
LS, RAW, TO_RAW = gate_rules(ANY_BLOCK, (*XCA_GATES, *CLASS_GATES), (*_TIMM, *_SHARED))
_, OFFICIAL_GATES, TO_OFFICIAL_GATES = gate_rules(ANY_BLOCK, (*XCA_GATES, *CLASS_GATES), (), "official")


def fuse_class_qkv(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """timm's class-attention ``attn.q``/``k``/``v`` weight or bias as the authors' fused ``attn.qkv`` at ``target``:
    the q key's operation concatenates the three (a copy); the k and v keys' give nothing."""
    if ".attn.q." not in key:
        return {}
    import torch

    return {target: torch.cat([state_dict[key.replace(".attn.q.", f".attn.{p}.")] for p in "qkv"])}


#: The authors' names into the ``ls`` layout (what timm's ``checkpoint_filter_fn`` does to them), and back.
OFFICIAL = (
    *OFFICIAL_GATES,
    Rule(r"pos_embeder\.(token_projection" + LINEAR + ")", r"pos_embed.\1"),
    Rule(rf"({CLASS_BLOCK}\.attn)\.qkv({LINEAR})", r"\1.{}\2", op=split_qkv(("q", "k", "v"))),
    *_SHARED,
)
TO_OFFICIAL = (
    *TO_OFFICIAL_GATES,
    Rule(r"pos_embed\.(token_projection" + LINEAR + ")", r"pos_embeder.\1"),
    Rule(rf"({CLASS_BLOCK}\.attn)\.[qkv]({LINEAR})", r"\1.qkv\2", op=fuse_class_qkv),
    *_SHARED,
)

BIBTEX = """\
@inproceedings{elnouby2021xcit,
  title     = {{XCiT}: Cross-Covariance Image Transformers},
  author    = {El-Nouby, Alaaeldin and Touvron, Hugo and Caron, Mathilde and Bojanowski, Piotr and Douze, Matthijs and
               Joulin, Armand and Laptev, Ivan and Neverova, Natalia and Synnaeve, Gabriel and Verbeek, Jakob and
               J{\\'e}gou, Herv{\\'e}},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  volume    = {34},
  pages     = {20014--20027},
  year      = {2021}
}"""

FAMILY = Family(
    "xcit",
    "XCiT",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout(
            "official", OFFICIAL, TO_OFFICIAL, timm_filtered("xcit"), tell=r"pos_embeder\..+", wrapper="model"
        ),
    },
    extra_blocks=2,
    full_title="XCiT (Cross-Covariance Image Transformers)",
    description="a Vision Transformer whose attention mixes channels (cross-covariance attention), with a "
    "convolutional local patch interaction in every block and two class-attention blocks; every residual branch is "
    "scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    blocks=ANY_BLOCK,
    gates=(*XCA_GATES, *CLASS_GATES),
    class_stage="cls_attn_blocks",
    head="head",
)

#: Width, depth, heads and LayerScale's initial value of each size (``tokens_norm``: all but nano).
_SIZES = {
    "nano_12": (128, 12, 4, 1.0),
    "tiny_12": (192, 12, 4, 1.0),
    "small_12": (384, 12, 8, 1.0),
    "tiny_24": (192, 24, 4, 1e-5),
    "small_24": (384, 24, 8, 1e-5),
    "medium_24": (512, 24, 8, 1e-5),
    "large_24": (768, 24, 16, 1e-5),
}


def _variant(size: str, patch: int, img: int) -> Variant:
    ref = f"xcit_{size}_p{patch}_{img}"
    dim, depth, heads, init = _SIZES[size]
    args = (("tokens_norm", size != "nano_12"),)
    return Variant(f"{ref}_ls", FAMILY, ref, img, dim, depth, heads, init, patch, f"{ref}.pth", args)


#: timm's XCiT architectures, nano to large, patch 16 and 8, at 224 and 384.
VARIANTS = tuple(_variant(size, patch, img) for patch in (16, 8) for size in _SIZES for img in (224, 384))
register(FAMILY, VARIANTS)
