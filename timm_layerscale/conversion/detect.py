"""The convertible architectures: which model a checkpoint becomes, and its reference.

A :class:`Variant` ties a target model name (registered with timm) to its family
(whose key rules live in :mod:`timm_layerscale.conversion.keys`) and, where timm has one, the
timm model that computes the same function from the original weights.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from ..errors import ArchitectureError

__all__ = ["Variant", "all_variants", "get_variant", "describe_state_dict", "detect_variant", "target_shapes"]


@dataclass(frozen=True)
class Variant:
    """A convertible architecture.

    Attributes:
        name: Target model name in timm's registry (``cait_s24_224_ls``).
        family: Key-rule family (``cait``, ``vit5``, ``deit3``).
        reference: timm model computing the same function from the official
            weights (``cait_s24_224``), or ``None`` when timm has none.
        img_size: Default input resolution (pixels).
        init_value: LayerScale initial value of the released model.
        target_layout: ``"ls"`` (``ls1.gamma``) or ``"gamma"``; the layout the
            converter writes by default.
    """

    name: str
    family: str
    reference: str | None
    img_size: int
    init_value: float | None
    target_layout: str = "ls"
    embed_dim: int | None = None
    depth: int | None = None


def _img_size(name: str) -> int:
    m = re.search(r"_(\d{3})(?:_|$)", name)
    return int(m.group(1)) if m else 224


@lru_cache(maxsize=None)
def all_variants() -> tuple[Variant, ...]:
    """Every convertible architecture, CaiT first, then ViT-5, then timm's DeiT-III."""
    import timm

    from ..models import cait_ls

    out = [
        Variant(name, "cait", cait_ls.REFERENCE[name], _img_size(name), args["init_values"],
                embed_dim=args["embed_dim"], depth=args["depth"])
        for name, args in cait_ls.MODEL_ARGS.items()
    ]
    try:
        from ..models import vit5
    except ImportError:
        vit5 = None
    if vit5 is not None:
        out += [
            Variant(name, "vit5", None, _img_size(name), args.get("init_values", 1e-4),
                    embed_dim=args.get("embed_dim"), depth=args.get("depth"))
            for name, args in vit5.MODEL_ARGS.items()
        ]
    from .keys import FAMILIES

    if "deit3" in FAMILIES:
        out += [
            Variant(name, "deit3", name, _img_size(name), None)
            for name in timm.list_models("deit3_*")
        ]
    return tuple(out)


def get_variant(name: str) -> Variant:
    """Return the variant called ``name`` (a pretrained tag after ``.`` is ignored).

    Raises:
        ArchitectureError: No convertible model has that name; the message lists close names.
    """
    base = name.split(".", 1)[0]
    for v in all_variants():
        if v.name == base:
            return v
    import difflib

    names = [v.name for v in all_variants()]
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "run 'timm-layerscale list' to see them"
    raise ArchitectureError(f"unknown model {name!r}; {hint}")


@lru_cache(maxsize=None)
def _meta_shapes(name: str, num_classes: int | None) -> dict[str, tuple[int, ...]]:
    import timm
    import torch

    kwargs: dict[str, Any] = {}
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    with torch.device("meta"):
        model = timm.create_model(name, **kwargs)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def target_shapes(variant: Variant, num_classes: int | None = None) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the target model's state dict (built on the meta device)."""
    return dict(_meta_shapes(variant.name, num_classes))


def describe_state_dict(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Summarise an architecture from a (prefix-free) state dict's shapes.

    Returns:
        A dict with whatever could be read: ``embed_dim``, ``depth``,
        ``class_attn_depth``, ``num_heads`` (from talking-heads ``proj_l``),
        ``grid`` (from ``pos_embed``), ``num_classes`` (from ``head``),
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


def detect_variant(checkpoint: Mapping[str, Any], model: str | None = None) -> tuple[Variant, dict[str, Any]]:
    """Find the registered variant a checkpoint fits, from its keys and shapes alone.

    Args:
        checkpoint: A state dict in any accepted layout (wrappers and prefixes allowed).
        model: A model name that overrides detection; it is checked like the rest.

    Returns:
        ``(variant, info)`` where ``info`` is :func:`describe_state_dict` of the
        checkpoint and ``info["num_classes"]`` is set when it differs from the
        variant's default (a fine-tuned head).

    Raises:
        ArchitectureError: Nothing fits; the message says what was found and names
            the closest variant: the one with the same kinds of keys (block indices
            aside), then the nearest width, depth and resolution, then the fewest
            mismatched keys.
        RemapError: ``model`` is given and the checkpoint does not fit it; the
            message lists the missing, unexpected and mis-shaped keys.
    """
    from .keys import FAMILIES, check_state_dict, to_layerscale, unwrap_state_dict
    from ..errors import RemapError

    try:
        raw = unwrap_state_dict(checkpoint)
    except RemapError as e:
        raise ArchitectureError(str(e)) from None
    candidates = [get_variant(model)] if model else list(all_variants())
    best: tuple[tuple[float, ...], int, Variant | None] = ((math.inf,), 0, None)
    info: dict[str, Any] = {}
    converted: dict[str, dict[str, Any] | None] = {}
    for family in dict.fromkeys(v.family for v in candidates):
        try:
            converted[family] = to_layerscale(raw, FAMILIES[family])
        except RemapError:
            if model:  # a named model: say which keys its rules do not cover
                raise
            converted[family] = None
    # Building a candidate's shapes costs a model construction (on meta): try the
    # variants whose width, depth and resolution already agree first.
    described = {f: describe_state_dict(sd) for f, sd in converted.items() if sd is not None}
    candidates.sort(key=lambda v: _unlikeliness(v, described[v.family]) if v.family in described else 99)
    for v in candidates:
        sd = converted[v.family]
        if sd is None:
            continue
        info = describe_state_dict(sd)
        num_classes = info.get("num_classes")
        shapes = _meta_shapes(v.name, None)
        if num_classes is not None and shapes.get("head.weight", (None,))[0] != num_classes:
            shapes = _meta_shapes(v.name, num_classes)
        bad = _mismatch(sd, shapes)
        if bad and model:  # a named model: list the missing, unexpected and mis-shaped keys
            check_state_dict(sd, shapes, v.name)
        if bad == 0:
            out = dict(info)
            if num_classes is not None and num_classes == _meta_shapes(v.name, None).get("head.weight", (None,))[0]:
                out.pop("num_classes")
            return v, out
        rank = (*_distance(v, shapes, info, _kinds(sd)), bad)
        if rank < best[0]:
            best = (rank, bad, v)
    if not info:
        from .keys import strip_prefixes

        info = describe_state_dict(strip_prefixes(raw))
    found = ", ".join(f"{k}={v}" for k, v in info.items()) or f"{len(raw)} keys of no known family"
    if best[2] is None:
        what = f"model {model!r}" if model else "any convertible model (CaiT, ViT-5, DeiT-III)"
        raise ArchitectureError(f"checkpoint does not fit {what}: found {found}; check the file")
    target = f"model {model!r}" if model else "any registered variant"
    raise ArchitectureError(
        f"checkpoint does not fit {target}: found {found}; closest is {best[2].name} "
        f"({best[1]} mismatched keys); pass model={best[2].name!r} to convert it as that and see the mismatches"
    )
