"""InternViT-300M (the vision tower of InternVL 2.5 and 3, arXiv 2412.05271): timm's ``vit_intern300m_patch14_448``
already holds LayerScale modules, so its state dict is this family's ``ls`` (and ``timm``) layout; the authors' files
(``modeling_intern_vit.py``: raw ``encoder.layers.N.ls1``/``ls2``; an InternVL chat checkpoint's ``vision_model.``
part) its ``official``, read by :mod:`~timm_layerscale.authors.internvit`; transformers' ``InternVLVisionModel``
folders (``lambda_1``/``lambda_2``, separate q, k and v) its ``transformers``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import KEEP, LINEAR, Family, Layout, Rule, Variant, register
from .loaders import timm_model, transformers_layout, without
from .operations import fuse_qkv, no_head, split_qkv
from .vit import VIT, gates

#: The authors' InternViT-300M (InternVL 2.5's), as the release pipeline fetches it.
AUTHORS_FILE = "hf-hub:OpenGVLab/InternViT-300M-448px-V2_5/model.safetensors"
_BLOCK_PARTS = r"(norm[12]|attn\.qkv|attn\.proj|mlp\.fc[12])"
#: timm's layout, which this family's ``ls`` is.
LS = (
    Rule(r"cls_token|pos_embed|(?:patch_embed\.proj|head)" + LINEAR, KEEP),
    Rule(rf"blocks\.\d+\.(?:{_BLOCK_PARTS}{LINEAR}|ls[12]\.gamma)", KEEP),
)
#: The parts of an InternVL chat checkpoint (``InternVLChatModel``) beside its ``vision_model.``.
CHAT = r"(?:language_model|mlp1)\..+"
#: The authors' keys, bare or a chat checkpoint's tower, into timm's; the chat model's other parts are left.
OFFICIAL = (
    Rule(CHAT, None, why="not the vision tower: the projector and the language model"),
    Rule(r"embeddings\.class_embedding", "cls_token"),
    Rule(r"embeddings\.position_embedding", "pos_embed"),
    Rule(rf"embeddings\.patch_embedding({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"encoder\.layers\.(\d+)\.{_BLOCK_PARTS}({LINEAR})", r"blocks.\1.\2\3"),
    Rule(r"encoder\.layers\.(\d+)\.ls([12])", r"blocks.\1.ls\2.gamma"),
)
#: timm's layout into the authors' ``InternVisionModel`` (no classifier).
TO_OFFICIAL = (
    Rule(r"cls_token", "embeddings.class_embedding"),
    Rule(r"pos_embed", "embeddings.position_embedding"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embedding\1"),
    Rule(rf"blocks\.(\d+)\.{_BLOCK_PARTS}({LINEAR})", r"encoder.layers.\1.\2\3"),
    Rule(r"blocks\.(\d+)\.ls([12])\.gamma", r"encoder.layers.\1.ls\2"),
    Rule(r"head" + LINEAR, KEEP, op=no_head("the authors' InternVisionModel")),
)
_HF_LAYER = r"encoder\.layer\.(\d+)"
_HF_NAMES = (
    ("attention.projection_layer", "attn.proj"),
    ("layernorm_before", "norm1"),
    ("layernorm_after", "norm2"),
    ("mlp.fc1", "mlp.fc1"),
    ("mlp.fc2", "mlp.fc2"),
)
#: transformers' ``InternVLVisionModel`` files into timm's names: q, k and v fused.
TRANSFORMERS = (
    Rule(r"embeddings\.cls_token", "cls_token"),
    Rule(r"embeddings\.position_embeddings", "pos_embed"),
    Rule(rf"embeddings\.patch_embeddings\.projection({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"{_HF_LAYER}\.attention\.[qkv]_proj\.(weight|bias)", r"blocks.\1.attn.qkv.\2", op=fuse_qkv),
    *(Rule(rf"{_HF_LAYER}\.{re.escape(theirs)}({LINEAR})", rf"blocks.\1.{ours}\2") for theirs, ours in _HF_NAMES),
    Rule(rf"{_HF_LAYER}\.lambda_([12])", r"blocks.\1.ls\2.gamma"),
)
#: timm's layout into transformers' names.
TO_TRANSFORMERS = (
    Rule(r"cls_token", "embeddings.cls_token"),
    Rule(r"pos_embed", "embeddings.position_embeddings"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embeddings.projection\1"),
    Rule(
        r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)",
        r"encoder.layer.\1.attention.{}.\2",
        op=split_qkv(("q_proj", "k_proj", "v_proj")),
    ),
    *(Rule(rf"blocks\.(\d+)\.{ours}({LINEAR})", rf"encoder.layer.\1.{theirs}\2") for theirs, ours in _HF_NAMES),
    Rule(r"blocks\.(\d+)\.ls([12])\.gamma", r"encoder.layer.\1.lambda_\2"),
    Rule(r"head" + LINEAR, KEEP, op=no_head("transformers' InternVLVisionModel")),
)


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``InternVLVisionConfig`` of a variant, set to what the authors' model computes: q/k/v biases,
    LayerNorm (eps 1e-6), no q/k norm, mean pooling (so no final norm)."""
    from transformers import InternVLVisionConfig

    return InternVLVisionConfig(
        hidden_size=variant.embed_dim,
        num_hidden_layers=variant.depth,
        num_attention_heads=variant.num_heads,
        intermediate_size=shapes["blocks.0.mlp.fc1.weight"][0],
        attention_bias=True,
        use_qk_norm=False,
        norm_type="layer_norm",
        layer_norm_eps=1e-6,
        use_mean_pooling=True,
        layer_scale_init_value=float(variant.init_value or 1.0),
        image_size=variant.img_size,
        patch_size=variant.patch_size,
    )


def _official(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """The authors' file's consumer: their model (:class:`~timm_layerscale.authors.internvit.InternVisionOfficial`),
    reading a bare file strictly, or a chat checkpoint's tower as the chat model holds it."""
    from ..authors.internvit import InternVisionOfficial

    size = args.get("img_size", variant.img_size)
    model_args = dict(embed_dim=variant.embed_dim, depth=variant.depth, num_heads=variant.num_heads)
    return lambda: InternVisionOfficial(size, variant.patch_size, **model_args), without(CHAT)


BIBTEX = """\
@article{chen2024internvl25,
  title   = {Expanding Performance Boundaries of Open-Source Multimodal Models with Model, Data, and Test-Time Scaling},
  author  = {Chen, Zhe and Wang, Weiyun and Cao, Yue and Liu, Yangzhou and Gao, Zhangwei and others},
  journal = {arXiv preprint arXiv:2412.05271},
  year    = {2024}
}"""


def _timm(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """timm's own model, read strictly; folded, without LayerScale (``init_values=0``)."""
    return timm_model(variant.name, {**args, **({"init_values": 0.0} if folded else {})})


_LS = Layout("ls", LS, LS, _timm)
FAMILY = Family(
    "internvit",
    "InternViT",
    {
        "ls": _LS,
        "timm": _LS,
        "official": Layout("official", OFFICIAL, TO_OFFICIAL, _official, tell=r"embeddings\.class_embedding"),
        "transformers": transformers_layout(
            TRANSFORMERS,
            TO_TRANSFORMERS,
            transformers_config,
            r"encoder\.layer\.\d+\.attention\.projection_layer\.weight",
            False,
        ),
    },
    tokens=True,
    full_title="InternViT-300M",
    description="the vision tower of InternVL 2.5 and 3, a Vision Transformer whose residual branches are scaled by "
    "LayerScale",
    bibtex=BIBTEX,
    license="mit",
    tower="vision_model.",
    **VIT,
    gates=gates(),
)

#: timm's InternViT (InternViT-300M-448px-V2_5, distilled from InternViT-6B).
VARIANTS = (
    Variant("vit_intern300m_patch14_448", FAMILY, "vit_intern300m_patch14_448", 448, 1024, 24, 16, 0.1, patch_size=14),
)
register(FAMILY, VARIANTS)
