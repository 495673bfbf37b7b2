"""BEiT and BEiT v2 (arXiv 2106.08254, 2208.06366): timm's ``beit_*``/``beitv2_*`` keep raw ``gamma_1``/``gamma_2``,
this package's ``*_ls`` (:mod:`timm_layerscale.models.beit_ls`) LayerScale modules; the authors' files
(microsoft/unilm ``beit/modeling_finetune.py``, ``{'model': ...}``) are timm's keys plus each block's
``relative_position_index`` buffer, which the model computes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model, transformers_layout
from .operations import fuse_qkv, no_head, split_qkv
from .vit import VIT, gates

ANY_BLOCK = r"blocks\.\d+"
_KEEP = (
    Rule(r"cls_token", KEEP),
    Rule(r"(?:patch_embed\.proj|fc_norm|norm|head)" + LINEAR, KEEP),
    Rule(rf"{ANY_BLOCK}\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + LINEAR, KEEP),
    Rule(rf"{ANY_BLOCK}\.attn\.(?:q_bias|v_bias|relative_position_bias_table)", KEEP),
)
GATES = gates("timm", "official")
LS, RAW, TO_RAW = gate_rules(VIT["blocks"], GATES, _KEEP)


def position_index(side: int) -> Any:
    """The relative position index of a ``side`` x ``side`` patch grid and the class token, ``(N + 1, N + 1)`` int64
    (``N = side ** 2``), as timm's ``gen_relative_position_index`` and the authors' attention compute it (a test
    compares): a patch pair's row and column offsets, each shifted to start at 0, into ``(2 side - 1) ** 2`` cells;
    then the class token's row, column and own cell."""
    import torch

    n, d = side * side, 2 * side - 1
    i, j = torch.arange(n) // side, torch.arange(n) % side
    index = torch.full((n + 1, n + 1), d * d + 1)  # column 0: a patch to the class token
    index[1:, 1:] = (i[:, None] - i[None] + side - 1) * d + j[:, None] - j[None] + side - 1
    index[0, 1:], index[0, 0] = d * d, d * d + 2
    return index


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
    Rule(rf"{ANY_BLOCK}\.attn\.relative_position_index", None, why=index_computed),
    Rule(r"rel_pos_bias\..+", None, why=_shared),
    *RAW,
)


def _index(variant: Variant) -> dict[str, Any]:
    """What the authors' file stores beyond timm's keys: each block's computed ``relative_position_index``."""
    index = position_index(variant.img_size // variant.patch_size)
    return {f"blocks.{n}.attn.relative_position_index": index for n in range(variant.depth)}


CLASSIFIER_PREFIX = r"(?:beit\.)?"  # BeitForImageClassification's prefix
HF_LAYER = rf"{CLASSIFIER_PREFIX}(?:encoder\.layer|layers)\.(\d+)"  # save_pretrained's names; 5.x's in memory
HF_ATTENTION = rf"{HF_LAYER}\.attention\.(?:attention\.)?"
TO_BLOCK = r"blocks.\1"
#: transformers' ``BeitModel`` files (``BeitForImageClassification``'s under ``beit.``, its classifier) into timm's
#: names: q, k and v fused, the k bias timm's zero third.
TRANSFORMERS = (
    Rule(rf"{CLASSIFIER_PREFIX}embeddings\.cls_token", "cls_token"),
    Rule(rf"{CLASSIFIER_PREFIX}embeddings\.patch_embeddings\.projection({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"{HF_ATTENTION}(?:query|key|value|[qkv]_proj)\.weight", rf"{TO_BLOCK}.attn.qkv.weight", op=fuse_qkv),
    Rule(rf"{HF_ATTENTION}(?:query|q_proj)\.bias", rf"{TO_BLOCK}.attn.q_bias"),
    Rule(rf"{HF_ATTENTION}(?:value|v_proj)\.bias", rf"{TO_BLOCK}.attn.v_bias"),
    Rule(rf"{HF_ATTENTION}(?:output\.dense|o_proj)({LINEAR})", rf"{TO_BLOCK}.attn.proj\2"),
    Rule(rf"{HF_LAYER}\.(?:attention\.attention\.)?relative_position_bias\.(\w+)", rf"{TO_BLOCK}.attn.\2"),
    Rule(rf"{HF_LAYER}\.layernorm_before({LINEAR})", rf"{TO_BLOCK}.norm1\2"),
    Rule(rf"{HF_LAYER}\.layernorm_after({LINEAR})", rf"{TO_BLOCK}.norm2\2"),
    Rule(rf"{HF_LAYER}\.(?:intermediate\.dense|mlp\.fc1)({LINEAR})", rf"{TO_BLOCK}.mlp.fc1\2"),
    Rule(rf"{HF_LAYER}\.(?:output\.dense|mlp\.fc2)({LINEAR})", rf"{TO_BLOCK}.mlp.fc2\2"),
    Rule(rf"{HF_LAYER}\.lambda_([12])", rf"{TO_BLOCK}.ls\2.gamma"),
    Rule(rf"{CLASSIFIER_PREFIX}pooler\.layernorm({LINEAR})", r"fc_norm\1"),
    Rule(rf"classifier({LINEAR})", r"head\1"),
    Rule(rf"{CLASSIFIER_PREFIX}encoder\.relative_position_bias\..+", None, why=_shared),
)
TO_HF_LAYER = r"encoder.layer.\1"
BLOCK_N = r"blocks\.(\d+)"
#: The ``ls`` layout into the names ``save_pretrained`` writes (4.x's, which 5.x reads).
TO_TRANSFORMERS = (
    Rule(r"cls_token", "embeddings.cls_token"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embeddings.projection\1"),
    Rule(
        rf"{BLOCK_N}\.attn\.qkv\.weight",
        rf"{TO_HF_LAYER}.attention.attention.{{}}.weight",
        op=split_qkv(("query", "key", "value")),
    ),
    Rule(rf"{BLOCK_N}\.attn\.q_bias", rf"{TO_HF_LAYER}.attention.attention.query.bias"),
    Rule(rf"{BLOCK_N}\.attn\.v_bias", rf"{TO_HF_LAYER}.attention.attention.value.bias"),
    Rule(rf"{BLOCK_N}\.attn\.proj({LINEAR})", rf"{TO_HF_LAYER}.attention.output.dense\2"),
    Rule(
        rf"{BLOCK_N}\.attn\.(relative_position_bias_table)",
        rf"{TO_HF_LAYER}.attention.attention.relative_position_bias.\2",
    ),
    Rule(rf"{BLOCK_N}\.norm1({LINEAR})", rf"{TO_HF_LAYER}.layernorm_before\2"),
    Rule(rf"{BLOCK_N}\.norm2({LINEAR})", rf"{TO_HF_LAYER}.layernorm_after\2"),
    Rule(rf"{BLOCK_N}\.mlp\.fc1({LINEAR})", rf"{TO_HF_LAYER}.intermediate.dense\2"),
    Rule(rf"{BLOCK_N}\.mlp\.fc2({LINEAR})", rf"{TO_HF_LAYER}.output.dense\2"),
    Rule(rf"{BLOCK_N}\.ls([12])\.gamma", rf"{TO_HF_LAYER}.lambda_\2"),
    Rule(rf"fc_norm({LINEAR})", r"pooler.layernorm\1"),
    Rule(r"head" + LINEAR, KEEP, op=no_head("transformers' BeitModel")),
)

_TELL = rf"{CLASSIFIER_PREFIX}embeddings\.patch_embeddings\.projection\.weight"  # a transformers file's key


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``BeitConfig`` of a variant: each block's relative position bias, mean pooling, timm's norm
    epsilon 1e-6 (transformers' default, 1e-12, is another function: a folder saying so is refused)."""
    from transformers import BeitConfig

    return BeitConfig(
        hidden_size=variant.embed_dim,
        num_hidden_layers=variant.depth,
        num_attention_heads=variant.num_heads,
        intermediate_size=shapes["blocks.0.mlp.fc1.weight"][0],
        image_size=variant.img_size,
        patch_size=variant.patch_size,
        use_relative_position_bias=True,
        use_absolute_position_embeddings=False,
        use_mean_pooling=True,
        layer_scale_init_value=float(variant.init_value or 0.1),
        layer_norm_eps=1e-6,
    )


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
        "transformers": transformers_layout(TRANSFORMERS, TO_TRANSFORMERS, transformers_config, _TELL, False),
    },
    full_title="BEiT",
    description="a Vision Transformer with a relative position bias in every block, pretrained by masked image "
    "modelling, whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    gamma_file="timm",
    **VIT,
    gates=GATES,
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
