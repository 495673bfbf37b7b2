"""DINOv2 (arXiv 2304.07193): timm's own ``vit_*_patch14[_reg4]_dinov2`` already use LayerScale modules, so its models
are this family's ``ls`` (and ``timm``) layout; the official files (``dinov2/models/vision_transformer.py``: bare state
dicts with ``mask_token``, ``register_tokens``, a class slot in ``pos_embed``, the giant's SwiGLU ``w12``/``w3``) its
``official`` layout, and transformers' ``Dinov2Model`` / ``Dinov2WithRegistersModel`` files its ``transformers``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import KEEP, LINEAR, Family, Layout, Rule, Variant, register, state_dict_shapes
from .loaders import authors_keys, timm_model, transformers_layout, without
from .operations import TRAINING_HEADS, UNUSED, fuse_qkv, no_head, split_qkv, training_heads, zeros_like_token
from .vit import VIT, gates


def merge_class_slot(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """With registers, the class token plus its slot of the position embedding (``pos_embed[:, :1]``), as timm's
    ``_reg4`` models hold it (they add no position to the class and register tokens): the same sum every forward
    pass computes, so the function is kept. Without registers the token as it is."""
    pos = next((v for k, v in state_dict.items() if k.endswith(("pos_embed", "position_embeddings"))), None)
    if pos is None or not any(k.endswith("register_tokens") for k in state_dict):
        return {target: tensor}
    return {target: tensor + pos[:, :1]}


def drop_class_slot(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """With registers, the position embedding without its class slot (merged into the class token by
    :func:`merge_class_slot`); without, as it is."""
    registers = any(k.endswith("register_tokens") for k in state_dict)
    return {target: tensor[:, 1:] if registers else tensor}


def zero_class_slot(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse for a ``_reg4`` model: a zero class slot in front (its class token already holds the position)."""
    import torch

    if "reg_token" not in state_dict:
        return {target: tensor}
    return {target: torch.cat([torch.zeros_like(tensor[:, :1]), tensor], dim=1)}


def packed_swiglu(names: tuple[str, str]) -> Any:
    """The operation naming timm's ``fc1``/``fc2`` as ``names`` (the official ``w12``/``w3``, transformers'
    ``weights_in``/``weights_out``) where the block's MLP is a packed SwiGLU (``fc1`` twice as wide as ``fc2``'s
    input), else ``fc1``/``fc2``."""

    def rename_packed_swiglu(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        block = key.rsplit(".mlp.", 1)[0]
        fc1, fc2 = state_dict.get(f"{block}.mlp.fc1.weight"), state_dict.get(f"{block}.mlp.fc2.weight")
        packed = fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1]
        return {target.format((names if packed else ("fc1", "fc2"))[".mlp.fc2." in key]): tensor}

    return rename_packed_swiglu


def _MASK(token: Any) -> tuple[int, int]:  # the official and transformers files' mask token: (1, C)
    return (1, token.shape[-1])


BLOCK_N = r"blocks\.(\d+)"
#: Keys the official layout and timm's share (the gates are ``ls1.gamma`` in both).
_SHARED = r"(?:patch_embed\.proj|norm)" + LINEAR + r"|blocks\.\d+\.(?:(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc[12])"
_SHARED += LINEAR + r"|ls[12]\.gamma)"
#: timm's own layout, which this family's ``ls`` is.
LS = (Rule(r"cls_token|pos_embed|reg_token|head" + LINEAR, KEEP), Rule(_SHARED, KEEP))
#: Official files into timm's names.
OFFICIAL = (
    Rule(r"mask_token", None, why=UNUSED),  # the masked-image objective's token
    training_heads(),
    Rule(r"register_tokens", "reg_token"),
    Rule(r"cls_token", "cls_token", op=merge_class_slot),
    Rule(r"pos_embed", "pos_embed", op=drop_class_slot),
    Rule(rf"{BLOCK_N}\.mlp\.w12({LINEAR})", r"blocks.\1.mlp.fc1\2"),
    Rule(rf"{BLOCK_N}\.mlp\.w3({LINEAR})", r"blocks.\1.mlp.fc2\2"),
    Rule(_SHARED, KEEP),
)
HF_LAYER = r"encoder\.layer\.(\d+)"
#: transformers' files (4.x's names, which ``save_pretrained`` still writes) into timm's.
TRANSFORMERS = (
    Rule(r"embeddings\.mask_token", None, why=UNUSED),
    Rule(r"embeddings\.register_tokens", "reg_token"),
    Rule(r"embeddings\.cls_token", "cls_token", op=merge_class_slot),
    Rule(r"embeddings\.position_embeddings", "pos_embed", op=drop_class_slot),
    Rule(rf"embeddings\.patch_embeddings\.projection({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"{HF_LAYER}\.(norm[12]{LINEAR})", r"blocks.\1.\2"),
    Rule(rf"{HF_LAYER}\.attention\.attention\.(?:query|key|value)({LINEAR})", r"blocks.\1.attn.qkv\2", op=fuse_qkv),
    Rule(rf"{HF_LAYER}\.attention\.output\.dense({LINEAR})", r"blocks.\1.attn.proj\2"),
    Rule(rf"{HF_LAYER}\.layer_scale([12])\.lambda1", r"blocks.\1.ls\2.gamma"),
    Rule(rf"{HF_LAYER}\.mlp\.(?:fc1|weights_in)({LINEAR})", r"blocks.\1.mlp.fc1\2"),
    Rule(rf"{HF_LAYER}\.mlp\.(?:fc2|weights_out)({LINEAR})", r"blocks.\1.mlp.fc2\2"),
    Rule(rf"layernorm({LINEAR})", r"norm\1"),
)
#: timm's layout into the official file, with a zero ``mask_token``, a zero class slot for ``_reg4`` (whose class
#: token holds its position), ``register_tokens`` and the giant's ``w12``/``w3``; no classifier.
TO_OFFICIAL = (
    Rule(r"cls_token", "cls_token", op=zeros_like_token(_MASK, "mask_token")),
    Rule(r"pos_embed", "pos_embed", op=zero_class_slot),
    Rule(r"reg_token", "register_tokens"),
    Rule(rf"{BLOCK_N}\.mlp\.fc([12])({LINEAR})", r"blocks.\1.mlp.{}\3", op=packed_swiglu(("w12", "w3"))),
    Rule(r"head" + LINEAR, KEEP, op=no_head("the official DINOv2 model")),
    Rule(_SHARED, KEEP),
)
TO_HF_LAYER = r"encoder.layer.\1"
#: timm's layout into transformers' (the names ``save_pretrained`` writes, which 4.x and 5.x load).
TO_TRANSFORMERS = (
    Rule(r"cls_token", "embeddings.cls_token", op=zeros_like_token(_MASK, "embeddings.mask_token")),
    Rule(r"pos_embed", "embeddings.position_embeddings", op=zero_class_slot),
    Rule(r"reg_token", "embeddings.register_tokens"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embeddings.projection\1"),
    Rule(rf"{BLOCK_N}\.(norm[12]{LINEAR})", rf"{TO_HF_LAYER}.\2"),
    Rule(
        rf"{BLOCK_N}\.attn\.qkv\.(weight|bias)",
        rf"{TO_HF_LAYER}.attention.attention.{{}}.\2",
        op=split_qkv(("query", "key", "value")),
    ),
    Rule(rf"{BLOCK_N}\.attn\.proj({LINEAR})", rf"{TO_HF_LAYER}.attention.output.dense\2"),
    Rule(rf"{BLOCK_N}\.ls([12])\.gamma", rf"{TO_HF_LAYER}.layer_scale\2.lambda1"),
    Rule(
        rf"{BLOCK_N}\.mlp\.fc([12])({LINEAR})",
        rf"{TO_HF_LAYER}.mlp.{{}}\3",
        op=packed_swiglu(("weights_in", "weights_out")),
    ),
    Rule(rf"norm({LINEAR})", r"layernorm\1"),
    Rule(r"head" + LINEAR, KEEP, op=no_head("transformers' Dinov2Model")),
)

_TELL = r"embeddings\.patch_embeddings\.projection\.weight"  # a transformers file's key


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``Dinov2Config`` (``Dinov2WithRegistersConfig`` with registers) of a variant, from its shapes."""
    import transformers

    fc1, fc2 = shapes["blocks.0.mlp.fc1.weight"], shapes["blocks.0.mlp.fc2.weight"]
    swiglu = fc1[0] == 2 * fc2[1]
    registers = "reg_token" in shapes
    cls: Any = transformers.Dinov2WithRegistersConfig if registers else transformers.Dinov2Config
    return cls(
        hidden_size=variant.embed_dim,
        num_hidden_layers=variant.depth,
        num_attention_heads=variant.num_heads,
        mlp_ratio=4 if swiglu else fc1[0] // variant.embed_dim,
        use_swiglu_ffn=swiglu,
        image_size=variant.img_size,
        patch_size=variant.patch_size,
        layerscale_value=float(variant.init_value or 1.0),
        layer_norm_eps=1e-6,
        **({"num_register_tokens": shapes["reg_token"][1]} if registers else {}),
    )


def official_keys(variant: Variant) -> set[str]:
    """The keys of the authors' ``DinoVisionTransformer`` of a variant (``dinov2/hub/backbones.py``: ``mask_token``,
    ``register_tokens`` with registers, the giant's packed SwiGLU ``w12``/``w3``, else ``fc1``/``fc2``; no head)."""
    shapes = state_dict_shapes(variant, 0)
    packed = shapes["blocks.0.mlp.fc1.weight"][0] == 2 * shapes["blocks.0.mlp.fc2.weight"][1]
    mlp = ("mlp.w12", "mlp.w3") if packed else ("mlp.fc1", "mlp.fc2")
    keys = {"cls_token", "pos_embed", "mask_token", *(["register_tokens"] if "reg_token" in shapes else [])}
    keys |= {f"{m}.{p}" for m in ("patch_embed.proj", "norm") for p in ("weight", "bias")}
    for n in range(variant.depth):
        keys |= {
            f"blocks.{n}.{m}.{p}" for m in ("norm1", "attn.qkv", "attn.proj", "norm2", *mlp) for p in ("weight", "bias")
        }
        keys |= {f"blocks.{n}.ls1.gamma", f"blocks.{n}.ls2.gamma"}
    return keys


def _timm(variant: Variant, folded: bool, args: dict[str, Any], official: bool = False) -> Any:
    """timm's own model, taking any input size, read strictly or (``official``) as the authors' strict loading reads
    the key set, then through timm's filter; folded, without LayerScale (``init_values=0``)."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    # any input size (the position embedding resampled as the official code and transformers do), so that
    # verification also runs a second, non-square size; at 518 x 518 nothing changes
    kwargs = {**args, "dynamic_img_size": True, **({"init_values": 0.0} if folded else {})}
    if not official:
        return timm_model(variant.name, kwargs)
    what = f"DinoVisionTransformer of {variant.name}"
    return timm_model(
        variant.name,
        kwargs,
        without(TRAINING_HEADS, authors_keys(official_keys(variant), "(?!)", what, checkpoint_filter_fn)),
    )


BIBTEX = """\
@article{oquab2023dinov2,
  title   = {{DINOv2}: Learning Robust Visual Features without Supervision},
  author  = {Oquab, Maxime and Darcet, Timoth{\\'e}e and Moutakanni, Th{\\'e}o and Vo, Huy V. and others},
  journal = {Transactions on Machine Learning Research},
  year    = {2024}
}"""

_LS = Layout("ls", LS, LS, _timm)
FAMILY = Family(
    "dinov2",
    "DINOv2",
    {
        "ls": _LS,
        "timm": _LS,
        "official": Layout(
            "official",
            OFFICIAL,
            TO_OFFICIAL,
            lambda v, folded, args: _timm(v, folded, args, official=True),
            tell=r"mask_token",
        ),
        "transformers": transformers_layout(TRANSFORMERS, TO_TRANSFORMERS, transformers_config, _TELL, False),
    },
    tokens=True,
    full_title="DINOv2",
    description="a self-supervised Vision Transformer (with registers in the _reg4 models) whose residual branches "
    "are scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    **VIT,
    gates=gates(),
)


def _variant(size: str, dim: int, depth: int, heads: int, reg: bool) -> Variant:
    name = f"vit_{size}_patch14{'_reg4' if reg else ''}_dinov2"
    return Variant(name, FAMILY, name, 518, dim, depth, heads, 1e-5, patch_size=14)


#: timm's DINOv2 architectures (``_reg4``: four registers, the class token's position folded into it).
VARIANTS = tuple(
    _variant(size, dim, depth, heads, reg)
    for reg in (False, True)
    for size, dim, depth, heads in (
        ("small", 384, 12, 6),
        ("base", 768, 12, 12),
        ("large", 1024, 24, 16),
        ("giant", 1536, 40, 24),
    )
)
register(FAMILY, VARIANTS)
