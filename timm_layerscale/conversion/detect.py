"""Which variant a checkpoint is, from its keys and shapes alone.

Reads the variant table (:data:`~timm_layerscale.families.VARIANTS`) and
the shapes it implies (:func:`state_dict_shapes`);
no model is built and neither torch nor timm is imported.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ArchitectureError, RemapError
from ..families import DEFAULT_NUM_CLASSES, FAMILIES, GATE_KEY, VARIANTS, Variant
from .keys import check_floating, check_state_dict, model_holders, strip_prefixes, to_layerscale, unwrap_state_dict

__all__ = [
    "Detection",
    "get_variant",
    "state_dict_shapes",
    "describe_state_dict",
    "detect",
    "detect_variant",
    "model_args",
    "timm_args",
]


def get_variant(name: str) -> Variant:
    """Return the variant called ``name`` (a pretrained tag after ``.`` is ignored).

    Raises:
        ArchitectureError: No convertible model has that name; the message lists close names.
    """
    base = name.split(".", 1)[0]
    for v in VARIANTS:
        if v.name == base:
            return v
    close = difflib.get_close_matches(base, [v.name for v in VARIANTS], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "run 'timm-layerscale list' to see them"
    raise ArchitectureError(f"unknown model {name!r}; {hint}")


def _linear(prefix: str, out: int, inp: int, bias: bool = True) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.weight": (out, inp)}
    if bias:
        shapes[f"{prefix}.bias"] = (out,)
    return shapes


def _norm(prefix: str, dim: int, bias: bool = True) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (dim,), **({f"{prefix}.bias": (dim,)} if bias else {})}


def state_dict_shapes(
    variant: Variant, num_classes: int | None = None, img_size: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the state dict of ``variant``'s model (``ls`` layout), computed from the table.

    Equal to ``{k: tuple(v.shape) for k, v in timm.create_model(variant.name,
    num_classes=..., img_size=...).state_dict().items()}`` (a test checks every variant), without timm.

    Args:
        variant: The architecture.
        num_classes: Classifier outputs (default 1000; 0: no classifier).
        img_size: Input resolution (default the variant's), which sets the position embedding's grid.
    """
    d, p, h = variant.embed_dim, variant.patch_size, variant.num_heads
    classes = DEFAULT_NUM_CLASSES if num_classes is None else num_classes
    rms = variant.family == "vit5"  # RMSNorm (weight only), no qkv bias, QK-norm, registers
    grid = (img_size or variant.img_size) // p
    out: dict[str, tuple[int, ...]] = {"cls_token": (1, 1, d)}
    if rms:
        out["reg_token"] = (1, 4, d)
    out["pos_embed"] = (1, grid * grid, d)
    out["patch_embed.proj.weight"] = (d, 3, p, p)
    out["patch_embed.proj.bias"] = (d,)

    def mlp(prefix: str) -> dict[str, tuple[int, ...]]:
        return {**_linear(f"{prefix}.mlp.fc1", 4 * d, d), **_linear(f"{prefix}.mlp.fc2", d, 4 * d)}

    for i in range(variant.depth):
        b = f"blocks.{i}"
        out.update(_norm(f"{b}.norm1", d, bias=not rms))
        out.update(_linear(f"{b}.attn.qkv", 3 * d, d, bias=not rms))
        if rms:
            out.update({f"{b}.attn.q_norm.weight": (d // h,), f"{b}.attn.k_norm.weight": (d // h,)})
        out.update(_linear(f"{b}.attn.proj", d, d))
        if variant.family == "cait":
            out.update({**_linear(f"{b}.attn.proj_l", h, h), **_linear(f"{b}.attn.proj_w", h, h)})
        out[f"{b}.ls1.gamma"] = (d,)
        out.update(_norm(f"{b}.norm2", d, bias=not rms))
        out.update(mlp(b))
        out[f"{b}.ls2.gamma"] = (d,)
    if variant.family == "cait":
        for j in range(2):
            b = f"blocks_token_only.{j}"
            out.update(_norm(f"{b}.norm1", d))
            for name in ("q", "k", "v", "proj"):
                out.update(_linear(f"{b}.attn.{name}", d, d))
            out[f"{b}.ls1.gamma"] = (d,)
            out.update(_norm(f"{b}.norm2", d))
            out.update(mlp(b))
            out[f"{b}.ls2.gamma"] = (d,)
    out.update(_norm("norm", d, bias=not rms))
    if classes:
        out.update(_linear("head", classes, d))
    return out


def describe_state_dict(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Summarise an architecture from a (prefix-free) state dict's shapes.

    Returns:
        A dict with whatever could be read: ``embed_dim``, ``depth``,
        ``class_attn_depth``, ``num_heads`` (from talking-heads ``proj_l``),
        ``grid`` (from ``pos_embed``), ``num_classes`` (from ``head``; 0 without one),
        ``registers``.
    """
    info: dict[str, Any] = {}
    pe = sd.get("patch_embed.proj.weight")
    if pe is not None:
        info["embed_dim"] = int(pe.shape[0])
        info["patch_size"] = int(pe.shape[-1])
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if blocks:
        info["depth"] = max(blocks) + 1
    ca = {int(m.group(1)) for k in sd if (m := re.match(r"blocks_token_only\.(\d+)\.", k))}
    if ca:
        info["class_attn_depth"] = max(ca) + 1
    pl = sd.get("blocks.0.attn.proj_l.weight")
    if pl is not None:
        info["num_heads"] = int(pl.shape[0])
    pos = sd.get("pos_embed")
    if pos is not None and pos.ndim == 3:
        n = int(pos.shape[1])
        side = math.isqrt(n)
        info["pos_tokens"] = n
        if side * side == n:
            info["grid"] = side
        elif math.isqrt(n - 1) ** 2 == n - 1:
            info["grid"] = math.isqrt(n - 1)
    reg = sd.get("reg_token")
    if reg is not None:
        info["registers"] = int(reg.shape[1])
    head = sd.get("head.weight")
    if head is not None:
        info["num_classes"] = int(head.shape[0])
    elif pe is not None and "head.bias" not in sd:  # a backbone saved without its classifier
        info["num_classes"] = 0
    return info


def _mismatch(sd: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> int:
    bad = sum(1 for k in shapes if k not in sd or tuple(sd[k].shape) != shapes[k])
    return bad + sum(1 for k in sd if k not in shapes)


def _unlikeliness(v: Variant, info: Mapping[str, Any]) -> float:
    """How many cheap facts (width, depth, resolution) rule a variant out; unknowns count half."""
    score = 0.0
    for have, want in (
        (v.embed_dim, info.get("embed_dim")),
        (v.depth, info.get("depth")),
        (v.img_size, info["grid"] * info["patch_size"] if "grid" in info and "patch_size" in info else None),
    ):
        if have is None or want is None:
            score += 0.5
        elif have != want:
            score += 1.0
    return score


def _kinds(keys: Any) -> set[str]:
    """Key names with block indices removed: what kinds of tensors a state dict holds."""
    return {re.sub(r"\.\d+\.", ".N.", k) for k in keys}


def _distance(
    v: Variant, shapes: Mapping[str, tuple[int, ...]], info: Mapping[str, Any], kinds: set[str]
) -> tuple[float, float, float, float]:
    """How far a variant is from a checkpoint: kinds of keys, then width, depth and resolution."""

    def gap(have: int | None, want: int | None) -> float:
        return math.inf if have is None or want is None else abs(have - want)

    described = describe_state_dict({k: _Shape(s) for k, s in shapes.items()})
    size = info["grid"] * info["patch_size"] if "grid" in info and "patch_size" in info else None
    return (
        len(_kinds(shapes) ^ kinds),
        gap(described.get("embed_dim"), info.get("embed_dim")),
        gap(described.get("depth"), info.get("depth")),
        gap(v.img_size, size),
    )


class _Shape:
    """A stand-in tensor with only a shape, for :func:`describe_state_dict`."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.ndim = len(shape)


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found.

    Attributes:
        variant: The variant the checkpoint fits.
        info: :func:`describe_state_dict` of the checkpoint; ``info["num_classes"]`` is
            set only when it differs from the variant's default (a fine-tuned head, or 0 for
            a backbone saved without one), ``info["img_size"]`` only for a checkpoint
            fine-tuned at a resolution that no variant of its architecture is registered at.
        state_dict: The checkpoint's state dict in the ``ls`` layout (same tensors).
    """

    variant: Variant
    info: dict[str, Any]
    state_dict: dict[str, Any]


def model_args(info: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments a model needs beyond its variant's to take a checkpoint that :func:`detect`
    described: ``num_classes`` and ``img_size``, where they differ from the variant's."""
    return {k: info[k] for k in ("num_classes", "img_size") if k in info}


def timm_args(model_args: Mapping[str, Any]) -> dict[str, Any]:
    """``timm.create_model`` arguments for :func:`model_args`: another ``img_size`` comes with the
    same ``input_size`` in the model's pretrained config, so that timm's data config, transforms
    and an exported ``config.json`` follow the resolution."""
    args = dict(model_args)
    if "img_size" in args:
        args["pretrained_cfg_overlay"] = {"input_size": (3, args["img_size"], args["img_size"])}
    return args


def detect_variant(checkpoint: Mapping[str, Any], model: str | None = None) -> tuple[Variant, dict[str, Any]]:
    """Find the registered variant a checkpoint fits: ``(variant, info)`` of :func:`detect`."""
    found = detect(strip_prefixes(_unwrap(checkpoint)), model)
    return found.variant, found.info


def _unwrap(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        return unwrap_state_dict(checkpoint)
    except RemapError as e:
        raise ArchitectureError(str(e)) from None


def detect(state_dict: Mapping[str, Any], model: str | None = None) -> Detection:
    """Find the registered variant a prefix-free state dict fits, from its keys and shapes alone.

    Args:
        state_dict: A state dict in any accepted layout, unwrapped, prefixes stripped
            (:func:`~timm_layerscale.conversion.keys.state_dict_of`).
        model: A model name that overrides detection; it is checked like the rest.

    Returns:
        A :class:`Detection`.

    Raises:
        ArchitectureError: Nothing fits; the message says what was found and names
            the closest variant: the one with the same kinds of keys (block indices
            aside), then the nearest width, depth and resolution, then the fewest
            mismatched keys.
        RemapError: ``model`` is given and the checkpoint does not fit it; the
            message lists the missing, unexpected and mis-shaped keys.
    """
    candidates = [get_variant(model)] if model else list(VARIANTS)
    best: tuple[tuple[float, ...], int, Variant | None] = ((math.inf,), 0, None)
    info: dict[str, Any] = {}
    converted: dict[str, dict[str, Any] | None] = {}
    for family in dict.fromkeys(v.family for v in candidates):
        try:
            converted[family] = to_layerscale(state_dict, FAMILIES[family])
        except RemapError:
            if model:  # a named model: say which keys its rules do not cover
                raise
            converted[family] = None
    # Try the variants whose width, depth and resolution already agree first.
    described = {f: describe_state_dict(sd) for f, sd in converted.items() if sd is not None}
    candidates.sort(key=lambda v: _unlikeliness(v, described[v.family]) if v.family in described else 99)
    for v in candidates:
        sd = converted[v.family]
        if sd is None:
            continue
        info = described[v.family]
        num_classes = info.get("num_classes")
        # The variant at the checkpoint's own resolution: one fine-tuned at another has only another
        # position-embedding grid. The variants registered at that resolution were tried first.
        size = info["grid"] * v.patch_size if "grid" in info else v.img_size
        resized = {"img_size": size} if size != v.img_size else {}
        shapes = state_dict_shapes(v, num_classes, size)
        bad = _mismatch(sd, shapes)
        if bad and _mismatch(sd, {k: s for k, s in shapes.items() if not GATE_KEY.fullmatch(k)}) == 0:
            raise ArchitectureError(
                f"checkpoint has the weights of {v.name} but no LayerScale gates: a model without LayerScale, "
                "or one with its gates folded into its weights; pass a LayerScale checkpoint (of a folded one, "
                "the file from before folding)"
            )
        if bad and model:  # a named model: list the missing, unexpected and mis-shaped keys
            check_state_dict(sd, shapes, v.name)
        if bad == 0:
            check_floating(sd, v.name)
            out = dict(info, **resized)
            if num_classes == DEFAULT_NUM_CLASSES:
                out.pop("num_classes")
            return Detection(v, out, sd)
        rank = (*_distance(v, shapes, info, _kinds(sd)), bad)
        if rank < best[0]:
            best = (rank, bad, v)
    if not info:
        info = describe_state_dict(state_dict)
    found = ", ".join(f"{k}={v}" for k, v in info.items()) or f"{len(state_dict)} key(s) of no known family"
    if state_dict and all(0 in getattr(v, "shape", (1,)) for v in state_dict.values()):
        raise ArchitectureError(
            "checkpoint holds no weights, every tensor is empty: a DeepSpeed ZeRO-3 file keeps them in other "
            "files; gather them first (with the zero_to_fp32.py saved beside it) and convert its output"
        )
    holders = model_holders(state_dict)
    if best[2] is None and holders:  # a training module's state dict: a model (or two) beside other keys
        raise ArchitectureError(
            f"checkpoint holds model weights under {', '.join(map(repr, holders))} beside other keys; "
            "save the state_dict() of one model alone and convert that"
        )
    if best[2] is None:
        what = f"model {model!r}" if model else "any convertible model (CaiT, ViT-5, DeiT-III)"
        raise ArchitectureError(f"checkpoint does not fit {what}: found {found}; check the file")
    target = f"model {model!r}" if model else "any registered variant"
    raise ArchitectureError(
        f"checkpoint does not fit {target}: found {found}; closest is {best[2].name} "
        f"({best[1]} mismatched keys); pass model={best[2].name!r} to read it as that and see the mismatches"
    )
