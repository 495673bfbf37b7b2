"""DINOv3 (arXiv 2508.10104): timm's ``vit_*_patch16_dinov3[_qkvb]`` (``Eva``) keep raw ``gamma_1``/``gamma_2`` (the
``timm`` layout), this package's ``*_ls`` (:mod:`timm_layerscale.models.dinov3_ls`) LayerScale modules; the authors'
files (``official``) and transformers' ``DINOv3ViTModel`` folders are read into either and written from them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Layout, Proof, Rule, Variant, gate_rules, register
from .loaders import authors_keys, own_model, timm_model, transformers_layout, without
from .operations import TRAINING_HEADS, UNUSED, fuse_qkv, no_head, split_qkv, training_heads, zeros_like_token
from .vit import VIT, gates

#: timm's names of the authors' SwiGLU ``w1``, ``w2``, ``w3``.
SWIGLU_NAMES = ("fc1_g", "fc1_x", "fc2")
#: The variant whose official file has no q/k/v bias (nor its mask) and keeps the norm of local crops' class token.
_7B = "vit_7b_patch16_dinov3_ls"
_PERIODS_BASE = 100.0


def _swiglu(variant: Variant) -> bool:
    return bool(dict(variant.args).get("swiglu_mlp"))


def official_keys(variant: Variant) -> tuple[set[str], str]:
    """The keys of the authors' ``DinoVisionTransformer`` of a variant (``dinov3/models/vision_transformer.py``, as
    ``hub/backbones.py`` builds the released ones; a plain MLP ``fc1``/``fc2``, SwiGLU ``w1``/``w2``/``w3``), and
    the pattern of those a file may hold or lack: the fused q/k/v bias and its mask (``qkv_bias``, ``mask_k_bias``),
    the norm of local crops' class tokens (``untie_global_and_local_cls_norm``: the 7B's, the satellite ViT-L's),
    EUPE's distillation projections."""
    linear = [
        "norm1",
        "attn.proj",
        "norm2",
        *(f"mlp.{m}" for m in (("w1", "w2", "w3") if _swiglu(variant) else ("fc1", "fc2"))),
    ]
    keys = {"cls_token", "storage_tokens", "mask_token", "rope_embed.periods"}
    keys |= {f"{m}.{p}" for m in ("patch_embed.proj", "norm") for p in ("weight", "bias")}
    for n in range(variant.depth):
        keys |= {f"blocks.{n}.{m}.{p}" for m in linear for p in ("weight", "bias")}
        keys |= {f"blocks.{n}.attn.qkv.weight", f"blocks.{n}.ls1.gamma", f"blocks.{n}.ls2.gamma"}
    return keys, r"blocks\.\d+\.attn\.qkv\.bias(?:_mask)?|local_cls_norm\.(?:weight|bias)|projectors\..+"


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


def _official(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """The official file's consumer: its key set checked as the authors' strict loading checks it, then timm's
    ``vit_*_dinov3`` through timm's own ``checkpoint_filter_fn`` (which drops the k third of the bias, its mask and
    the rotary periods unseen: this package's rules prove them inert on their values first)."""
    from timm.models.eva import checkpoint_filter_fn

    biased = dict(variant.args).get("qkv_bias")

    def read(sd: dict[str, Any], model: Any) -> Any:  # zero q and v biases, which timm's filter skips without them
        return checkpoint_filter_fn(sd if biased else _without_zero_biases(sd), model)

    required, optional = official_keys(variant)
    checked = authors_keys(required, optional, f"DinoVisionTransformer of {variant.name}", read)
    return timm_model(str(variant.reference), args, without(TRAINING_HEADS, checked))


BIBTEX = """\
@article{simeoni2025dinov3,
  title   = {{DINOv3}},
  author  = {Sim{\\'e}oni, Oriane and Vo, Huy V. and Seitzer, Maximilian and Baldassarre, Federico and others},
  journal = {arXiv preprint arXiv:2508.10104},
  year    = {2025}
}"""


def _mask(dim: int) -> Any:
    import torch

    return torch.cat([torch.ones(dim), torch.zeros(dim), torch.ones(dim)])


def mask_101(key: str, mask: Any, state_dict: Mapping[str, Any]) -> str:
    """The proof that a ``bias_mask`` is inert once the k third of its bias is dropped: it is exactly ``[1, 0, 1]``.

    Raises:
        RemapError: Any other mask, which scales the q or v bias or lets a k bias through.
    """
    import torch

    if mask.ndim != 1 or not torch.equal(mask.float(), _mask(mask.numel() // 3)):
        raise RemapError(
            f"checkpoint's {key} is not [1, 0, 1] (ones, a zero k third, ones), the masking timm's DINOv3 computes; "
            "it cannot be converted"
        )
    return "bias_mask [1, 0, 1]"


def split_qkv_bias(prefix: str, bias: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The official fused ``qkv.bias`` ``(3C,)`` as timm's ``q_bias`` and ``v_bias`` ``(C,)`` (views); its k third,
    which timm keeps a zero buffer, is dropped only where it is zero or the file's ``bias_mask`` is ``[1, 0, 1]``.

    Raises:
        RemapError: A k third that is not zero and no ``[1, 0, 1]`` mask zeroes (the training config's
            ``mask_k_bias: false``), or one holding NaN or Inf, which a mask keeps.
    """
    import torch

    q, k, v = bias.chunk(3)
    mask = state_dict.get(f"{key}_mask")
    if not k.any():
        proof = "k third zero"
    elif mask is not None and not torch.isfinite(k).all():
        raise RemapError(
            f"checkpoint's {key} has NaN or Inf in its k third; the authors' model computes bias * bias_mask, which "
            "keeps them (NaN * 0 is NaN), so every output would be NaN: it cannot be converted"
        )
    elif mask is not None and mask_101(f"{key}_mask", mask, state_dict):
        proof = "k third masked by bias_mask [1, 0, 1]"
    else:
        raise RemapError(
            f"checkpoint's {key} has a non-zero k third and no bias_mask [1, 0, 1] zeroes it (mask_k_bias: false); "
            "timm's DINOv3 models hold no k bias, so it cannot be converted"
        )
    return {f"{prefix}.q_bias": q, f"{prefix}.v_bias": v, f"{key}[k]": Proof(None, proof)}


def periods(head_dim: int) -> Any:
    """The rotary periods ``(head_dim // 4,)`` of a head ``head_dim`` wide, fp32, base 100, as timm's
    ``RotaryEmbeddingDinoV3`` (and the authors' code) computes them, by the same operations (a test compares)."""
    import torch

    return _PERIODS_BASE ** (2.0 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))


def periods_computed(key: str, value: Any, state_dict: Mapping[str, Any]) -> str:
    """The proof that an official file's ``rope_embed.periods`` are those the model computes: equal within one unit
    of bf16 (the released files round them to bf16).

    Raises:
        RemapError: Other periods: the model was trained with other rotary settings.
    """
    import torch

    want = periods(4 * value.numel())
    if value.shape != want.shape or not torch.allclose(value.float(), want, rtol=2**-8, atol=0.0):
        raise RemapError(
            f"checkpoint's {key} are not the rotary periods timm's DINOv3 computes (base {_PERIODS_BASE:g}); "
            "it was trained with other rotary settings and cannot be converted"
        )
    return "periods computed"


def mask_token_finite(key: str, token: Any, state_dict: Mapping[str, Any]) -> str:
    """The proof that the authors' ``mask_token`` is inert at inference: their model adds ``0 * mask_token`` to the
    class token, which is zero only where the token is finite.

    Raises:
        RemapError: The token holds NaN or Inf, which reach every output of the authors' model.
    """
    import torch

    if not torch.isfinite(token).all():
        raise RemapError(
            f"checkpoint's {key} holds NaN or Inf; the authors' DINOv3 adds 0 * {key} to the class token, so every "
            "output would be NaN: it cannot be converted"
        )
    return f"finite, added times zero: {UNUSED}"


#: The official layout's keys (``dinov3/models/vision_transformer.py``) into timm's names; each drop with its proof.
OFFICIAL = (
    Rule(r"storage_tokens", "reg_token"),
    Rule(r"mask_token", None, why=mask_token_finite),  # the masked-image objective's token
    Rule(r"rope_embed\.periods", None, why=periods_computed),
    Rule(r"blocks\.\d+\.attn\.qkv\.bias_mask", None, why=mask_101),
    Rule(r"local_cls_norm" + LINEAR, None, why=UNUSED),  # the norm of local crops' class tokens, in training
    training_heads(),
    Rule(r"projectors\..+", None, why="training head"),  # EUPE's distillation projections
    Rule(r"(blocks\.\d+\.attn)\.qkv\.bias", r"\1", op=split_qkv_bias),
    Rule(r"blocks\.\d+\.ls[12]\.gamma", KEEP),
    *(Rule(rf"(blocks\.\d+\.mlp)\.w{i}({LINEAR})", rf"\1.{name}\2") for i, name in enumerate(SWIGLU_NAMES, 1)),
)


def up_proj(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``up_proj`` is timm's ``fc1`` in a plain MLP, ``fc1_x`` beside a ``gate_proj`` (SwiGLU)."""
    gated = key.replace(".up_proj.", ".gate_proj.") in state_dict
    return {target.replace(".fc1.", ".fc1_x.") if gated else target: tensor}


HF_LAYER = r"(?:model\.)?layer\.(\d+)"
#: transformers' ``DINOv3ViTModel`` files (the names ``save_pretrained`` writes; 5.x's ``model.layer`` too) into
#: timm's: q, k and v projections fused, ``mask_token`` (pretraining only) dropped.
TRANSFORMERS = (
    Rule(r"embeddings\.cls_token", "cls_token"),
    Rule(r"embeddings\.register_tokens", "reg_token"),
    Rule(r"embeddings\.mask_token", None, why=UNUSED),
    Rule(rf"embeddings\.patch_embeddings({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"{HF_LAYER}\.(norm[12]{LINEAR})", r"blocks.\1.\2"),
    Rule(rf"{HF_LAYER}\.attention\.[qkv]_proj\.weight", r"blocks.\1.attn.qkv.weight", op=fuse_qkv),
    Rule(rf"{HF_LAYER}\.attention\.([qv])_proj\.bias", r"blocks.\1.attn.\2_bias"),
    Rule(rf"{HF_LAYER}\.attention\.o_proj({LINEAR})", r"blocks.\1.attn.proj\2"),
    Rule(rf"{HF_LAYER}\.layer_scale([12])\.lambda1", r"blocks.\1.ls\2.gamma"),
    Rule(rf"{HF_LAYER}\.mlp\.gate_proj({LINEAR})", r"blocks.\1.mlp.fc1_g\2"),
    Rule(rf"{HF_LAYER}\.mlp\.up_proj({LINEAR})", r"blocks.\1.mlp.fc1\2", op=up_proj),
    Rule(rf"{HF_LAYER}\.mlp\.down_proj({LINEAR})", r"blocks.\1.mlp.fc2\2"),
    Rule(r"norm" + LINEAR, KEEP),
)
BLOCK_N = r"blocks\.(\d+)"
#: The ``ls`` layout into transformers' names: ``qkv`` split, a zero ``mask_token`` ``(1, 1, C)`` beside the class
#: token (transformers' model has one, unused at inference).
TO_TRANSFORMERS = (
    Rule(r"cls_token", "embeddings.cls_token", op=zeros_like_token(lambda t: tuple(t.shape), "embeddings.mask_token")),
    Rule(r"reg_token", "embeddings.register_tokens"),
    Rule(rf"patch_embed\.proj({LINEAR})", r"embeddings.patch_embeddings\1"),
    Rule(rf"{BLOCK_N}\.(norm[12]{LINEAR})", r"layer.\1.\2"),
    Rule(
        rf"{BLOCK_N}\.attn\.qkv\.weight", r"layer.\1.attention.{}.weight", op=split_qkv(("q_proj", "k_proj", "v_proj"))
    ),
    Rule(rf"{BLOCK_N}\.attn\.([qv])_bias", r"layer.\1.attention.\2_proj.bias"),
    Rule(rf"{BLOCK_N}\.attn\.proj({LINEAR})", r"layer.\1.attention.o_proj\2"),
    Rule(rf"{BLOCK_N}\.ls([12])\.gamma", r"layer.\1.layer_scale\2.lambda1"),
    Rule(rf"{BLOCK_N}\.mlp\.fc1_g({LINEAR})", r"layer.\1.mlp.gate_proj\2"),
    Rule(rf"{BLOCK_N}\.mlp\.fc1(?:_x)?({LINEAR})", r"layer.\1.mlp.up_proj\2"),
    Rule(rf"{BLOCK_N}\.mlp\.fc2({LINEAR})", r"layer.\1.mlp.down_proj\2"),
    Rule(r"norm" + LINEAR, KEEP),
    Rule(r"head" + LINEAR, KEEP, op=no_head("transformers' DINOv3ViTModel")),
)

_TELL = r"embeddings\.patch_embeddings\.weight"  # a transformers file's key


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``DINOv3ViTConfig`` of a variant, from its registered model's shapes (``ls`` layout)."""
    from transformers import DINOv3ViTConfig

    gated = "blocks.0.mlp.fc1_g.weight" in shapes
    biased = "blocks.0.attn.q_bias" in shapes
    return DINOv3ViTConfig(
        hidden_size=variant.embed_dim,
        num_hidden_layers=variant.depth,
        num_attention_heads=variant.num_heads,
        intermediate_size=shapes["blocks.0.mlp.fc1_g.weight" if gated else "blocks.0.mlp.fc1.weight"][0],
        use_gated_mlp=gated,
        hidden_act="silu" if gated else "gelu",
        query_bias=biased,
        key_bias=False,
        value_bias=biased,
        num_register_tokens=shapes["reg_token"][1],
        patch_size=variant.patch_size,
        image_size=variant.img_size,
        layer_norm_eps=1e-5,
        rope_theta=_PERIODS_BASE,
        layerscale_value=float(variant.init_value or 1.0),
    )


def join_qkv_bias(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_qkv_bias`: timm's ``q_bias`` and ``v_bias`` as the official fused ``qkv.bias``
    ``(3C,)`` with a zero k third, and its ``bias_mask`` ``[1, 0, 1]``; the v key's operation gives nothing."""
    import torch

    if key.endswith("v_bias"):
        return {}
    bias = torch.cat([tensor, torch.zeros_like(tensor), state_dict[key.replace("q_bias", "v_bias")]])
    return {target: bias, f"{target}_mask": Proof(_mask(tensor.numel()), "ones, a zero k third, ones")}


def official_buffers(variant: Variant) -> dict[str, Any]:
    """What an official file holds that the ``ls`` layout does not: ``rope_embed.periods`` as timm computes them
    (fp32; the released files hold them rounded to bf16); for a variant without q and v biases a zero ``qkv.bias``
    with its ``bias_mask`` ``[1, 0, 1]``, none for the 7B, which keeps the norm of local crops' class tokens instead
    (identity weights: unused at inference)."""
    import torch

    dim, out = variant.embed_dim, {"rope_embed.periods": periods(variant.embed_dim // variant.num_heads)}
    if variant.name == _7B:
        norm = {"local_cls_norm.weight": torch.ones(dim), "local_cls_norm.bias": torch.zeros(dim)}
        return {**out, **{k: Proof(v, f"identity, {UNUSED}") for k, v in norm.items()}}
    if not dict(variant.args).get("qkv_bias"):
        for n in range(variant.depth):
            out[f"blocks.{n}.attn.qkv.bias"] = Proof(torch.zeros(3 * dim), "zeros: the variant has no q/k/v bias")
            out[f"blocks.{n}.attn.qkv.bias_mask"] = Proof(_mask(dim), "ones, a zero k third, ones")
    return out


_BLOCK = r"blocks\.\d+\.(?:(?:norm1|norm2|attn\.proj|mlp\.fc1|mlp\.fc1_g|mlp\.fc1_x|mlp\.fc2)" + LINEAR
_KEEP = (
    Rule(r"cls_token|reg_token", KEEP),
    Rule(r"(?:patch_embed\.proj|norm|head)" + LINEAR, KEEP),
    Rule(_BLOCK + r"|attn\.qkv\.weight|attn\.q_bias|attn\.v_bias)", KEEP),
)
_SHARED = (
    Rule(r"cls_token", KEEP),
    Rule(r"(?:patch_embed\.proj|norm)" + LINEAR, KEEP),
    Rule(r"blocks\.\d+\.(?:(?:norm1|norm2|attn\.proj|mlp\.fc1|mlp\.fc2)" + LINEAR + r"|attn\.qkv\.weight)", KEEP),
)


def w3_or_fc2(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """timm's ``fc2`` as the authors name it: ``w3`` beside a gate (SwiGLU), else ``fc2`` (a plain MLP)."""
    return {target if key.replace(".fc2.", ".fc1_g.") in state_dict else key: tensor}


#: The ``ls`` layout into the official file (:func:`official_buffers` adds what it computes): ``storage_tokens``,
#: a zero ``(1, C)`` ``mask_token``, the fused ``qkv.bias``, SwiGLU ``w1``/``w2``/``w3``; no classifier.
TO_OFFICIAL = (
    Rule(r"reg_token", "storage_tokens"),
    Rule(r"cls_token", KEEP, op=zeros_like_token(lambda t: (1, t.shape[-1]), "mask_token")),
    Rule(r"(blocks\.\d+\.attn)\.[qv]_bias", r"\1.qkv.bias", op=join_qkv_bias),
    *(
        Rule(rf"(blocks\.\d+\.mlp)\.{name}({LINEAR})", rf"\1.w{i}\2")
        for i, name in enumerate(SWIGLU_NAMES, 1)
        if name != "fc2"
    ),
    Rule(rf"(blocks\.\d+\.mlp)\.fc2({LINEAR})", r"\1.w3\2", op=w3_or_fc2),
    Rule(r"head" + LINEAR, KEEP, op=no_head("the official DINOv3 model")),
    Rule(r"blocks\.\d+\.ls[12]\.gamma", KEEP),
    *_SHARED,
)
GATES = gates("timm")
LS, RAW, TO_RAW = gate_rules(VIT["blocks"], GATES, _KEEP)
# a source's zero q and v biases, which a plain variant computes as well without them
_LS = Layout("ls", LS, LS, own_model, optional_zero=r"blocks\.\d+\.attn\.[qv]_bias")

FAMILY = Family(
    "dinov3",
    "DINOv3",
    {
        "ls": _LS,
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout(
            "official", (*OFFICIAL, *_SHARED), TO_OFFICIAL, _official, tell=r"storage_tokens", buffers=official_buffers
        ),
        "transformers": transformers_layout(TRANSFORMERS, TO_TRANSFORMERS, transformers_config, _TELL, True),
    },
    tokens=True,
    full_title="DINOv3",
    description="a self-supervised Vision Transformer with 2-D rotary position embedding and four register "
    "tokens, whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    gamma_file="timm",
    **VIT,
    gates=GATES,
)


def _variant(size: str, dim: int, depth: int, heads: int, qkvb: bool, **args: Any) -> Variant:
    ref = f"vit_{size}_patch16_dinov3" + ("_qkvb" if qkvb else "")
    return Variant(f"{ref}_ls", FAMILY, ref, 256, dim, depth, heads, 1e-5, args=(("qkv_bias", qkvb), *args.items()))


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
register(FAMILY, VARIANTS)
