"""DINOv3 (arXiv 2508.10104): timm's ``vit_*_patch16_dinov3[_qkvb]`` (``Eva``) keep raw ``gamma_1``/``gamma_2``
(the ``gamma`` layout here), this package's ``*_ls`` (:mod:`timm_layerscale.models.dinov3_ls`) LayerScale modules;
the official files (``official``) are read into either."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Rule, Variant, layerscale_rules, own_model, register
from .transformers_layout import (
    TRAINING_HEADS,
    fuse_qkv,
    native_transformers,
    split_qkv,
    without_training_heads,
    zeros_like_token,
)


def _variant(size: str, dim: int, depth: int, heads: int, qkvb: bool, **args: Any) -> Variant:
    ref = f"vit_{size}_patch16_dinov3" + ("_qkvb" if qkvb else "")
    return Variant(f"{ref}_ls", "dinov3", ref, 256, dim, depth, heads, 1e-5, args=(("qkv_bias", qkvb), *args.items()))


_W = ("fc1_g", "fc1_x", "fc2")
_SWIGLU = {"swiglu_mlp": True, "swiglu_align_to": 8}
#: timm's DINOv3 architectures (``_qkvb``: the q and v biases of the distilled releases).
VARIANTS = (
    _variant("tiny", 192, 12, 3, True),
    *(_variant("small", 384, 12, 6, b) for b in (False, True)),
    *(_variant("small_plus", 384, 12, 6, b, **_SWIGLU) for b in (False, True)),
    *(_variant("base", 768, 12, 12, b) for b in (False, True)),
    *(_variant("large", 1024, 24, 16, b) for b in (False, True)),
    *(_variant("huge_plus", 1280, 32, 20, b, **_SWIGLU) for b in (False, True)),
    _variant("7b", 4096, 40, 32, False, mlp_ratio=2.0, swiglu_mlp=True, swiglu_align_to=64),
)


def native(variant: Variant, layout: str, folded: bool, args: dict[str, Any]) -> Any:
    """``gamma`` (timm's) and ``official``: timm's ``vit_*_dinov3`` through timm's own ``checkpoint_filter_fn``;
    ``ls``: this package's model; ``transformers``: transformers' ``DINOv3ViTModel``."""
    if layout == "ls":
        return own_model(variant, folded, args)
    if layout == "transformers":
        return native_transformers(transformers_config, variant, args, any_size=True)
    import timm
    from timm.models.eva import checkpoint_filter_fn

    biased = dict(variant.args).get("qkv_bias")

    def read(sd: dict[str, Any], model: Any) -> Any:  # zero q and v biases, which timm's filter skips without them
        return checkpoint_filter_fn(sd if biased else _without_zero_biases(sd), model)

    return lambda: timm.create_model(str(variant.reference), **args), without_training_heads(read)


def _without_zero_biases(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict without the q and v biases (``q_bias``, ``v_bias``; an official ``qkv.bias`` and its mask) that
    are zero; those that are not stay (and do not load into a model without biases)."""

    def zero(key: str) -> bool:
        if key.endswith("qkv.bias_mask"):
            return zero(key.removesuffix("_mask"))
        if key.endswith("qkv.bias"):
            q, _, v = state_dict[key].chunk(3)
            return not (q.any() or v.any())
        return key.endswith(("attn.q_bias", "attn.v_bias")) and not state_dict[key].any()

    return {k: v for k, v in state_dict.items() if not zero(k)}


BIBTEX = """\
@article{simeoni2025dinov3,
  title   = {{DINOv3}},
  author  = {Sim{\\'e}oni, Oriane and Vo, Huy V. and Seitzer, Maximilian and Baldassarre, Federico and others},
  journal = {arXiv preprint arXiv:2508.10104},
  year    = {2025}
}"""


def split_qkv_bias(prefix: str, bias: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The official fused ``qkv.bias`` ``(3C,)`` as timm's ``q_bias`` and ``v_bias`` ``(C,)`` (views): its k third is
    what the official ``bias_mask`` zeroes in every forward pass, and timm keeps the k bias a zero buffer."""
    q, _, v = bias.chunk(3)
    return {f"{prefix}.q_bias": q, f"{prefix}.v_bias": v}


#: The official layout's keys (``dinov3/models/vision_transformer.py``) into timm's names; ``None``: dropped, and
#: why. Its gates are ``ls1.gamma`` already, its SwiGLU ``w1``/``w2``/``w3`` timm's ``fc1_g``/``fc1_x``/``fc2``.
OFFICIAL = (
    Rule(r"storage_tokens", "reg_token"),
    Rule(r"mask_token", None),  # the masked-image objective's token, used in pretraining only
    Rule(r"rope_embed\.periods", None),  # computed by timm's rotary embedding from the same constants
    Rule(r"blocks\.\d+\.attn\.qkv\.bias_mask", None),  # the k third's zeroing, which timm's zero k bias does
    Rule(r"local_cls_norm" + LINEAR, None),  # the 7B's norm of local-crop class tokens, in pretraining only
    Rule(TRAINING_HEADS, None),  # the objective's heads of a training checkpoint
    Rule(r"projectors\..+", None),  # EUPE's distillation projections, in training only
    Rule(r"(blocks\.\d+\.attn)\.qkv\.bias", r"\1", op=split_qkv_bias),
    *(Rule(rf"(blocks\.\d+\.mlp)\.w{i}({LINEAR})", rf"\1.{name}\2") for i, name in enumerate(_W, 1)),
)


def up_proj(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``up_proj`` is timm's ``fc1`` in a plain MLP, ``fc1_x`` beside a ``gate_proj`` (SwiGLU)."""
    gated = key.replace(".up_proj.", ".gate_proj.") in state_dict
    return {target.replace(".fc1.", ".fc1_x.") if gated else target: tensor}


def no_head(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    raise RemapError(
        f"transformers' DINOv3ViTModel has no classifier to hold {key!r}; convert to another layout, or the backbone"
    )


_L = r"(?:model\.)?layer\.(\d+)"
#: transformers' ``DINOv3ViTModel`` files (the names ``save_pretrained`` writes; 5.x's ``model.layer`` too) into
#: timm's: q, k and v projections fused, ``mask_token`` (pretraining only) dropped.
TRANSFORMERS = (
    Rule(r"embeddings\.cls_token", "cls_token"),
    Rule(r"embeddings\.register_tokens", "reg_token"),
    Rule(r"embeddings\.mask_token", None),
    Rule(rf"embeddings\.patch_embeddings({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"{_L}\.(norm[12]{LINEAR})", r"blocks.\1.\2"),
    Rule(rf"{_L}\.attention\.[qkv]_proj\.weight", r"blocks.\1.attn.qkv.weight", op=fuse_qkv),
    Rule(rf"{_L}\.attention\.([qv])_proj\.bias", r"blocks.\1.attn.\2_bias"),
    Rule(rf"{_L}\.attention\.o_proj({LINEAR})", r"blocks.\1.attn.proj\2"),
    Rule(rf"{_L}\.layer_scale([12])\.lambda1", r"blocks.\1.ls\2.gamma"),
    Rule(rf"{_L}\.mlp\.gate_proj({LINEAR})", r"blocks.\1.mlp.fc1_g\2"),
    Rule(rf"{_L}\.mlp\.up_proj({LINEAR})", r"blocks.\1.mlp.fc1\2", op=up_proj),
    Rule(rf"{_L}\.mlp\.down_proj({LINEAR})", r"blocks.\1.mlp.fc2\2"),
)
_B = r"blocks\.(\d+)"
#: The ``ls`` layout into transformers' names: ``qkv`` split, a zero ``mask_token`` ``(1, 1, C)`` beside the class
#: token (transformers' model has one, unused at inference).
TO_TRANSFORMERS = (
    Rule(r"cls_token", "embeddings.cls_token", op=zeros_like_token(lambda t: tuple(t.shape), "embeddings.mask_token")),
    Rule(r"reg_token", "embeddings.register_tokens"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embeddings\1"),
    Rule(rf"{_B}\.(norm[12]{LINEAR})", r"layer.\1.\2"),
    Rule(rf"{_B}\.attn\.qkv\.weight", r"layer.\1.attention.{}.weight", op=split_qkv(("q_proj", "k_proj", "v_proj"))),
    Rule(rf"{_B}\.attn\.([qv])_bias", r"layer.\1.attention.\2_proj.bias"),
    Rule(rf"{_B}\.attn\.proj({LINEAR})", r"layer.\1.attention.o_proj\2"),
    Rule(rf"{_B}\.ls([12])\.gamma", r"layer.\1.layer_scale\2.lambda1"),
    Rule(rf"{_B}\.mlp\.fc1_g({LINEAR})", r"layer.\1.mlp.gate_proj\2"),
    Rule(rf"{_B}\.mlp\.fc1(?:_x)?({LINEAR})", r"layer.\1.mlp.up_proj\2"),
    Rule(rf"{_B}\.mlp\.fc2({LINEAR})", r"layer.\1.mlp.down_proj\2"),
    Rule(r"norm" + LINEAR, KEEP),
    Rule(r"head" + LINEAR, KEEP, op=no_head),
)


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``DINOv3ViTConfig`` of a variant, from its registered model's shapes (``ls`` layout)."""
    from transformers import DINOv3ViTConfig

    gated = "blocks.0.mlp.fc1_g.weight" in shapes
    biased = "blocks.0.attn.q_bias" in shapes
    return DINOv3ViTConfig(
        hidden_size=variant.embed_dim, num_hidden_layers=variant.depth, num_attention_heads=variant.num_heads,
        intermediate_size=shapes["blocks.0.mlp.fc1_g.weight" if gated else "blocks.0.mlp.fc1.weight"][0],
        use_gated_mlp=gated, hidden_act="silu" if gated else "gelu", query_bias=biased, key_bias=False,
        value_bias=biased, num_register_tokens=shapes["reg_token"][1], patch_size=variant.patch_size,
        image_size=variant.img_size, layer_norm_eps=1e-5, rope_theta=100.0, layerscale_value=float(variant.init_value or 1.0),
    )  # fmt: skip


def join_qkv_bias(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_qkv_bias`: timm's ``q_bias`` and ``v_bias`` as the official fused ``qkv.bias``
    ``(3C,)`` with a zero k third (which its ``bias_mask`` zeroes anyway); the v key's operation gives nothing."""
    import torch

    if key.endswith("v_bias"):
        return {}
    return {target: torch.cat([tensor, torch.zeros_like(tensor), state_dict[key.replace("q_bias", "v_bias")]])}


def no_official_head(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    raise RemapError(f"the official DINOv3 model has no classifier to hold {key!r}; convert to another layout")


#: Variants whose official file has no q/k/v bias (nor its mask).
_NO_QKV_BIAS = ("vit_7b_patch16_dinov3_ls",)


def official_buffers(variant: Variant, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """What an official file holds that the ``ls`` layout does not: ``rope_embed.periods`` as timm computes them
    (fp32; the released files hold them rounded to bf16), each block's ``qkv.bias_mask`` (ones, zeros for the k
    third) and, for a variant without q and v biases, a zero ``qkv.bias``; nothing for the 7B's biases."""
    import torch
    from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3

    head_dim = variant.embed_dim // variant.num_heads
    out = {"rope_embed.periods": RotaryEmbeddingDinoV3(head_dim, temperature=100.0).periods}
    if variant.name in _NO_QKV_BIAS:
        return out
    ones, zeros = torch.ones(variant.embed_dim), torch.zeros(variant.embed_dim)
    biased = dict(variant.args).get("qkv_bias")
    for n in range(variant.depth):
        out[f"blocks.{n}.attn.qkv.bias_mask"] = torch.cat([ones, zeros, ones])
        out.update({} if biased else {f"blocks.{n}.attn.qkv.bias": torch.zeros(3 * variant.embed_dim)})
    return out


_BLOCK = r"blocks\.\d+\.(?:(?:norm1|norm2|attn\.proj|mlp\.fc1|mlp\.fc1_g|mlp\.fc1_x|mlp\.fc2)" + LINEAR
_KEEP = (
    Rule(r"cls_token|reg_token", KEEP),
    Rule(r"(?:patch_embed\.proj|norm|head)" + LINEAR, KEEP),
    Rule(_BLOCK + r"|attn\.qkv\.weight|attn\.q_bias|attn\.v_bias)", KEEP),
)

#: The ``ls`` layout into the official file (:func:`official_buffers` adds what it computes): ``storage_tokens``,
#: a zero ``(1, C)`` ``mask_token``, the fused ``qkv.bias``, SwiGLU ``w1``/``w2``/``w3``; no classifier.
TO_OFFICIAL = (
    Rule(r"reg_token", "storage_tokens"),
    Rule(r"cls_token", KEEP, op=zeros_like_token(lambda t: (1, t.shape[-1]), "mask_token")),
    Rule(r"(blocks\.\d+\.attn)\.[qv]_bias", r"\1.qkv.bias", op=join_qkv_bias),
    *(Rule(rf"(blocks\.\d+\.mlp)\.{name}({LINEAR})", rf"\1.w{i}\2") for i, name in enumerate(_W, 1)),
    Rule(r"head" + LINEAR, KEEP, op=no_official_head),
    Rule(r"blocks\.\d+\.ls[12]\.gamma", KEEP),
    *_KEEP,
)

FAMILY = Family(
    "dinov3",
    "DINOv3",
    *layerscale_rules(r"blocks", _KEEP, ls_only=(*OFFICIAL, *TRANSFORMERS)),
    native=native,
    source_layouts=(("official", r"storage_tokens"), ("transformers", r"embeddings\.patch_embeddings\.weight")),
    targets=(("transformers", TO_TRANSFORMERS), ("official", TO_OFFICIAL)),
    independent=("transformers",),
    transformers_config=transformers_config,
    tokens=True,
    computed=r"rope_embed\.periods",
    official_buffers=official_buffers,
    official_layout="official",
    optional_zero=r"blocks\.\d+\.attn\.[qv]_bias",  # the distilled releases' all-zero q and v biases
    full_title="DINOv3",
    description="a self-supervised Vision Transformer with 2-D rotary position embedding and four register "
    "tokens, whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
)
register(FAMILY, VARIANTS)
