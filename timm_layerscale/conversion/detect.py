"""Which registered variant a state dict is, from its keys and shapes against the registered models' own, built
on the meta device."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import families
from ..errors import ArchitectureError, option
from ..families import (
    DEFAULT_NUM_CLASSES,
    FAMILIES,
    Family,
    Layout,
    Variant,
    get_variant,
    model_holders,
    state_dict_shapes,
)
from .rules import (
    Change,
    UncoveredKeys,
    check_floating,
    check_state_dict,
    mismatches,
    read_layout,
    without_zero_optional,
)

__all__ = ["Detection", "NoGates", "Twins", "describe_state_dict", "detect", "state_dict_shapes", "timm_args"]


def describe_state_dict(sd: Mapping[str, Any], family: Family) -> dict[str, int]:
    """What the shapes of a state dict in ``family``'s ``ls`` layout say of its architecture, where they can be read:
    ``embed_dim`` (its patch embedding's, else its first gate's width), ``patch_size``, ``depth`` (blocks before a
    class-attention stage), ``grid`` (its position embedding's side) and ``num_classes`` (0: a backbone saved without
    its head)."""
    info: dict[str, int] = {}
    gates = {k: found[0] for k in sd if (found := family.gate_of(k))}
    stem = sd.get(family.stem)
    if stem is not None:
        info.update(embed_dim=int(stem.shape[0]), patch_size=int(stem.shape[-1]))
    elif gates:  # a gate is as wide as the blocks of its stage
        info["embed_dim"] = int(sd[min(gates)].shape[-1])
    blocks = {block for block in gates.values() if not re.match(family.class_stage, block)}
    if blocks:
        info["depth"] = len(blocks)
    pos = sd.get(family.positions)
    if pos is not None and pos.ndim == 3:
        n = int(pos.shape[1])
        for side in (math.isqrt(n), math.isqrt(n - 1)):
            if side * side in (n, n - 1):
                info["grid"] = side
                break
    if f"{family.head}.weight" in sd:
        info["num_classes"] = int(sd[f"{family.head}.weight"].shape[0])
    elif family.head and f"{family.head}.bias" not in sd:
        info["num_classes"] = 0
    return info


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found: the variant the state dict fits, ``overrides`` (``num_classes`` and ``img_size``
    where they differ from the variant's: a fine-tuned head, a backbone, another resolution), the state dict in the
    ``ls`` layout (the same tensors), the source's :class:`~timm_layerscale.families.Layout` and what reading it
    did to each key (:data:`~timm_layerscale.conversion.rules.Change`)."""

    variant: Variant
    overrides: dict[str, int]
    state_dict: dict[str, Any]
    layout: Layout
    changes: list[Change]


def timm_args(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``timm.create_model`` arguments for a detection's ``overrides``: another ``img_size`` comes with the same
    ``input_size`` in the pretrained config, which timm's data config and ``config.json`` follow."""
    args = dict(overrides)
    if "img_size" in args:
        args["pretrained_cfg_overlay"] = {"input_size": (3, args["img_size"], args["img_size"])}
    return args


def _unlikeliness(v: Variant, info: Mapping[str, int]) -> float:
    """How many of width, depth and resolution rule ``v`` out (unknowns count half): the variant
    registered at a file's own resolution is tried before one it would fit resampled."""
    size = info["grid"] * info["patch_size"] if "grid" in info and "patch_size" in info else None
    pairs = ((v.embed_dim, info.get("embed_dim")), (v.depth, info.get("depth")), (v.img_size, size))
    return sum(0.5 if want is None else float(have != want) for have, want in pairs)


def _twins(
    v: Variant, candidates: Iterable[Variant], shapes: Mapping[str, Any], classes: int | None, size: int | None
) -> list[str]:
    """The other variants of ``v``'s family and resolution whose state dicts have ``v``'s ``shapes`` (BEiT and BEiT v2
    of one size): a file of one cannot be told from a file of the other."""
    alike = (w for w in candidates if w is not v and w.family is v.family and w.img_size == v.img_size)
    same = (w for w in alike if (w.embed_dim, w.depth, w.num_heads) == (v.embed_dim, v.depth, v.num_heads))
    return [w.name for w in same if state_dict_shapes(w, classes, size) == shapes]


class NoGates(ArchitectureError):
    """A state dict with a variant's weights but no LayerScale gates: a model without LayerScale, or a folded one."""


class Twins(ArchitectureError):
    """A state dict fits two registered variants alike (``names``); the message names them."""

    def __init__(self, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.names = names


def detect(
    state_dict: Mapping[str, Any], model: str | None = None, container: tuple[str | None, str] | None = None
) -> Detection:
    """Find the registered variant a prefix-free state dict fits, and the layout of its family it is in.

    Args:
        state_dict: Unwrapped, prefixes stripped (:func:`~timm_layerscale.conversion.checkpoint.state_dict_of`).
        model: A model name that overrides detection; it is checked like the rest.
        container: ``(wrapper, prefix)`` of the file (:func:`~timm_layerscale.conversion.checkpoint.container_of`),
            which tells apart layouts of the same keys (CaiT's official file and timm's state dict).

    Raises:
        ArchitectureError: Nothing fits; the message names the variant with the fewest
            mismatched keys and what they are.
        RemapError: ``model`` is given and the state dict does not fit it (every missing,
            unexpected and mis-shaped key listed), or a tensor its layout drops is not inert.
    """
    candidates = [get_variant(model)] if model else list(families.VARIANTS)
    read: dict[Family, tuple[Layout, dict[str, Any], list[Change]]] = {}
    for family in dict.fromkeys(v.family for v in candidates):
        changes: list[Change] = []
        try:
            layout, sd = read_layout(state_dict, family, container, changes)
        except UncoveredKeys:
            if model:  # a named model: say which keys its rules do not cover
                raise
            continue
        read[family] = layout, sd, changes
    described = {f: describe_state_dict(sd, f) for f, (_, sd, _) in read.items()}
    # of the width read (its patch embedding, else its gates): building every registered model would take minutes
    fits = [v for v in candidates if v.family in read and described[v.family].get("embed_dim") in (None, v.embed_dim)]
    candidates = sorted(fits if fits or not model else candidates, key=lambda v: _unlikeliness(v, described[v.family]))
    best: tuple[int, Variant, str] | None = None
    for v in candidates:
        (layout, sd, changes), info = read[v.family], described[v.family]
        if model:  # a named variant may leave zero biases out
            sd = without_zero_optional(sd, v.family, state_dict_shapes(v), v.name)
        # a fine-tune at another resolution, read from its position embedding (a model without one takes any size)
        size = info["grid"] * v.patch_size if "grid" in info else None
        shapes = state_dict_shapes(v, info.get("num_classes"), size)
        count, detail = mismatches(sd, shapes)
        if count and not mismatches(sd, {k: s for k, s in shapes.items() if not v.family.gate_of(k)})[0]:
            raise NoGates(
                f"checkpoint has the weights of {v.name} but no LayerScale gates: a model without LayerScale, "
                "or one with its gates folded into its weights; pass a LayerScale checkpoint (of a folded one, "
                "the file from before folding)"
            )
        if count and model:
            check_state_dict(sd, shapes, v.name)
        if not count:
            if not model and (twins := _twins(v, candidates, shapes, info.get("num_classes"), size)):
                raise Twins(
                    f"checkpoint fits {v.name} and {', '.join(twins)} alike (the same shapes); name the one it is: "
                    f"{' or '.join(option('model', name) for name in (v.name, *twins))}",
                    (v.name, *twins),
                )
            check_floating(sd, v.name)
            classes = info.get("num_classes", DEFAULT_NUM_CLASSES)
            overrides = {"num_classes": classes} if classes != DEFAULT_NUM_CLASSES else {}
            overrides.update({"img_size": size} if size not in (None, v.img_size) else {})
            return Detection(v, overrides, sd, layout, changes)
        if best is None or count < best[0]:
            best = (count, v, detail)
    if state_dict and all(0 in getattr(v, "shape", (1,)) for v in state_dict.values()):
        raise ArchitectureError(
            "checkpoint holds no weights, every tensor is empty: a DeepSpeed ZeRO-3 file keeps them in other "
            "files; gather them first (with the zero_to_fp32.py saved beside it) and convert its output"
        )
    info = next(iter(described.values()), {})
    found = ", ".join(f"{k}={v}" for k, v in info.items()) or f"{len(state_dict)} key(s) of no known family"
    holders = model_holders(state_dict)
    if best is None and holders:  # a training module's state dict: a model beside other keys
        raise ArchitectureError(
            f"checkpoint holds model weights under {', '.join(map(repr, holders))} beside other keys; "
            "save the state_dict() of one model alone and convert that"
        )
    if best is None:
        what = (
            f"model {model!r}" if model else f"any convertible model ({', '.join(f.title for f in FAMILIES.values())})"
        )
        raise ArchitectureError(f"checkpoint does not fit {what}: found {found}; check the file")
    count, v, detail = best
    raise ArchitectureError(
        f"checkpoint does not fit any registered variant: found {found}; closest is {v.name} ({detail}); "
        f"pass {option('model', v.name)} to read it as that"
    )
