"""BEiT and BEiT v2 (arXiv 2106.08254, 2208.06366): timm's ``beit_*``/``beitv2_*`` keep raw ``gamma_1``/``gamma_2``,
this package's ``*_ls`` (:mod:`timm_layerscale.models.beit_ls`) LayerScale modules; the authors' files
(microsoft/unilm ``beit/modeling_finetune.py``, ``{'model': ...}``) are timm's keys plus each block's
``relative_position_index`` buffer, which the model computes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model

_B = r"blocks\.\d+"
_KEEP = (
    Rule(r"cls_token", KEEP),
    Rule(r"(?:patch_embed\.proj|fc_norm|norm|head)" + LINEAR, KEEP),
    Rule(rf"{_B}\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + LINEAR, KEEP),
    Rule(rf"{_B}\.attn\.(?:q_bias|v_bias|relative_position_bias_table)", KEEP),
)
LS, RAW, TO_RAW = gate_rules("blocks", _KEEP)


def position_index(side: int) -> Any:
    """The relative position index of a ``side`` x ``side`` patch grid and the class token, ``(N + 1, N + 1)`` int64
    (``N = side ** 2``), as timm and the authors' attention compute it."""
    from timm.models.beit import gen_relative_position_index

    return gen_relative_position_index((side, side))


def index_computed(key: str, value: Any, state_dict: Mapping[str, Any]) -> str:
    """The proof that a stored ``relative_position_index`` is the one the model computes for its grid.

    Raises:
        RemapError: Another index: the file's attention looks its bias table up differently.
    """
    import math

    import torch

    side = math.isqrt(value.shape[0] - 1)
    if value.ndim != 2 or not torch.equal(value.long(), position_index(side)):
        raise RemapError(f"checkpoint's {key} is not the index of a {side} x {side} grid the model computes")
    return "index computed"


def _shared(key: str, value: Any, state_dict: Mapping[str, Any]) -> str:
    raise RemapError(
        f"checkpoint has {key}: one relative position bias shared by every block (a pretraining checkpoint); "
        "convert a fine-tuned file, whose blocks hold their own tables"
    )


#: The authors' files into timm's names, each block's index dropped where it is the computed one.
OFFICIAL = (
    Rule(rf"{_B}\.attn\.relative_position_index", None, why=index_computed),
    Rule(r"rel_pos_bias\..+", None, why=_shared),
    *RAW,
)


def _index(variant: Variant) -> dict[str, Any]:
    """What the authors' file stores beyond timm's keys: each block's computed ``relative_position_index``."""
    index = position_index(variant.img_size // variant.patch_size)
    return {f"blocks.{n}.attn.relative_position_index": index for n in range(variant.depth)}


BIBTEX = """\
@inproceedings{bao2022beit,
  title     = {{BEiT}: {BERT} Pre-Training of Image Transformers},
  author    = {Bao, Hangbo and Dong, Li and Piao, Songhao and Wei, Furu},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2022}
}"""

FAMILY = Family(
    "beit",
    "BEiT",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout(
            "official",
            OFFICIAL,
            TO_RAW,
            timm_filtered("beit"),
            tell=r".+\.relative_position_index",
            wrapper="model",
            buffers=_index,
        ),
    },
    full_title="BEiT",
    description="a Vision Transformer with a relative position bias in every block, pretrained by masked image "
    "modelling, whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    gamma_file="timm",
)

_ARGS = (("use_abs_pos_emb", False), ("use_rel_pos_bias", True))


def _variant(name: str, img: int, dim: int, depth: int, heads: int, init: float) -> Variant:
    return Variant(f"{name}_ls", FAMILY, name, img, dim, depth, heads, init, args=_ARGS)


#: timm's BEiT and BEiT v2 architectures (``beit3_*`` have no LayerScale). A ``beit_`` and a ``beitv2_`` model of one
#: size have the same shapes: a file of either is read as the one ``--model`` names.
VARIANTS = (
    _variant("beit_base_patch16_224", 224, 768, 12, 12, 0.1),
    _variant("beit_base_patch16_384", 384, 768, 12, 12, 0.1),
    _variant("beit_large_patch16_224", 224, 1024, 24, 16, 1e-5),
    _variant("beit_large_patch16_384", 384, 1024, 24, 16, 1e-5),
    _variant("beit_large_patch16_512", 512, 1024, 24, 16, 1e-5),
    _variant("beitv2_base_patch16_224", 224, 768, 12, 12, 1e-5),
    _variant("beitv2_large_patch16_224", 224, 1024, 24, 16, 1e-5),
)
register(FAMILY, VARIANTS)
