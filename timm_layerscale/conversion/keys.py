"""Key rules between the official ``gamma`` layout (``blocks.N.gamma_1``) and the ``ls`` module layout
(``blocks.N.ls1.gamma``). No I/O; tensors pass through unchanged (the same objects, or views where a rule's
value operation splits one), so a memory-mapped checkpoint stays unread.

A source key is matched against its family's ordered rules (:mod:`timm_layerscale.families`); the
first match renames, keeps or drops it, and a key no rule matches is an error that names it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, TypeVar

from ..errors import RemapError, option
from ..families import GATE_KEY, Family, get_family

__all__ = [
    "EMA_KEYS",
    "WRAPPER_KEYS",
    "check_floating",
    "check_state_dict",
    "detect_layout",
    "dropped",
    "mismatches",
    "remap",
    "model_holders",
    "official_checkpoint",
    "state_dict_of",
    "strip_prefixes",
    "to_gamma",
    "to_layerscale",
    "unwrap_state_dict",
]

V = TypeVar("V")

#: The names of the EMA weights, the official DeiT / ViT-5 code's and then timm's train.py's.
EMA_KEYS = ("model_ema", "state_dict_ema")
#: DeepSpeed's model-states file uses 'module', DINO's teacher_checkpoint.pth 'teacher'.
_MAIN_KEYS = ("model", "state_dict", "module", "teacher")
#: Keys that wrap a state dict inside a training checkpoint, in order of preference.
WRAPPER_KEYS = _MAIN_KEYS + EMA_KEYS
#: Prefixes of DistributedDataParallel and torch.compile.
PREFIXES = ("module.", "_orig_mod.")
#: The name DINO's training code gives the backbone, beside the objective's heads (``dino_head.``, ``ibot_head.``).
BACKBONE = "backbone."
_CHUNKED = re.compile(r"^blocks\.\d+\.(\d+\.)")


def official_checkpoint(state_dict: Mapping[str, V], family: str | Family) -> dict[str, Any]:
    """``{'model': {prefix + key: tensor}}``, as the official training code saves a ``gamma``-layout
    state dict (prefix ``'module.'`` for CaiT, none for DeiT-III and ViT-5)."""
    fam = family if isinstance(family, Family) else get_family(family)
    return {"model": {fam.official_prefix + k: v for k, v in state_dict.items()}}


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(k, str) for k in obj)


def unwrap_state_dict(checkpoint: Mapping[str, Any], wrapper: str | None = None) -> Mapping[str, Any]:
    """The state dict inside a training checkpoint: under ``wrapper`` if named (``'model_ema'`` also
    finds timm's ``'state_dict_ema'``), else the first of ``'model'``, ``'state_dict'``, ``'module'``;
    a checkpoint that is a state dict already is returned as it is.

    Raises:
        RemapError: ``wrapper`` is absent, or the checkpoint holds only EMA weights and none were asked for.
    """
    if not isinstance(checkpoint, Mapping):
        raise RemapError(f"checkpoint is a {type(checkpoint).__name__}, not a dict of tensors; save a state_dict()")
    if wrapper is not None:
        for key in EMA_KEYS if wrapper in EMA_KEYS else (wrapper,):
            if _is_state_dict(checkpoint.get(key)):
                return checkpoint[key]
        found = ", ".join(k for k in WRAPPER_KEYS if k in checkpoint) or "none"
        advice = f"leave out {option('ema')}" if wrapper in EMA_KEYS else "name a wrapper it has"
        raise RemapError(f"checkpoint has no {wrapper!r} state dict (wrappers found: {found}); {advice}")
    for key in _MAIN_KEYS:
        if _is_state_dict(checkpoint.get(key)):
            return checkpoint[key]
    ema = [k for k in EMA_KEYS if _is_state_dict(checkpoint.get(k))]
    if ema and not any(hasattr(v, "shape") for v in checkpoint.values()):
        raise RemapError(
            f"checkpoint holds only an EMA state dict ({ema[0]!r}); ask for it explicitly: pass {option('ema')}"
        )
    return checkpoint


def model_holders(keys: Iterable[str]) -> list[str]:
    """The names of the modules holding a model among ``keys`` (``'model.'`` for ``model.patch_embed.proj.weight``)."""
    return sorted(k.removesuffix("patch_embed.proj.weight") for k in keys if k.endswith(".patch_embed.proj.weight"))


def _renamed(state_dict: Mapping[str, V], rename: Callable[[str], str]) -> dict[str, V]:
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        new = rename(key)
        if new in out:
            raise RemapError(f"two keys become {new!r} once prefixes are removed; the checkpoint is ambiguous")
        out[new] = value
    return out


def _strip(key: str) -> str:
    while key.startswith(PREFIXES):
        key = key.removeprefix(PREFIXES[0]).removeprefix(PREFIXES[1])
    return key


def strip_prefixes(state_dict: Mapping[str, V]) -> dict[str, V]:
    """Remove ``module.`` and ``_orig_mod.`` from every key (repeatedly); then the name of a module wrapping the
    whole model (a PyTorch Lightning module's ``model.``) where every key has it, and DINO's ``backbone.`` where
    other keys (the objective's heads, which a family's rules drop by name) lie beside it; then block chunks:
    DINOv2's training code nests its blocks as ``blocks.K.N.`` (``N`` the block's own index), read as ``blocks.N.``.

    Raises:
        RemapError: Two keys become one.
    """
    out = _renamed(state_dict, _strip)
    holders = model_holders(out)
    if len(holders) == 1 and (holders[0] == BACKBONE or all(k.startswith(holders[0]) for k in out)):
        out = _renamed(out, lambda k: k.removeprefix(holders[0]))
    blocks = [k for k in out if k.startswith("blocks.")]
    if blocks and all(_CHUNKED.match(k) for k in blocks):
        out = _renamed(out, lambda k: _CHUNKED.sub(r"blocks.\1", k, count=1))
    return out


def state_dict_of(checkpoint: Mapping[str, Any], ema: bool = False) -> dict[str, Any]:
    """The state dict of a checkpoint, unwrapped (:func:`unwrap_state_dict`) and prefixes stripped."""
    return strip_prefixes(unwrap_state_dict(checkpoint, "model_ema" if ema else None))


def detect_layout(state_dict: Mapping[str, Any]) -> str:
    """``"gamma"``, ``"ls"`` or ``"none"``: the LayerScale layout of a prefix-free state dict.

    Raises:
        RemapError: Both layouts are present.
    """
    gates = [m for k in state_dict if (m := GATE_KEY.fullmatch(k))]
    has_gamma, has_ls = any(m["g"] for m in gates), any(m["l"] for m in gates)
    if has_gamma and has_ls:
        raise RemapError(
            "checkpoint mixes gamma_1/gamma_2 and ls1.gamma/ls2.gamma keys; it is not a layout this tool knows"
        )
    return "gamma" if has_gamma else "ls" if has_ls else "none"


def _remap(
    state_dict: Mapping[str, V], family: str | Family, to: str, changes: list[tuple[str, str]] | None = None
) -> dict[str, V]:
    fam = get_family(family) if isinstance(family, str) else family
    sd = strip_prefixes(state_dict)
    detect_layout(sd)
    out: dict[str, V] = {}
    unknown: list[str] = []
    rules = fam.rules(to)
    for key, value in sd.items():
        for rule in rules:
            matched, new_key = rule.apply(key)
            if matched:
                break
        else:
            unknown.append(key)
            continue
        if new_key is None:
            if changes is not None:
                changes.append((key, ""))
            continue
        result = rule.op(new_key, value, key, sd) if rule.op else {new_key: value}
        if changes is not None and rule.op and not (len(result) == 1 and next(iter(result.values())) is value):
            changes.append((key, rule.op.__name__))  # a split, a fusion or a merge, not a renaming
        for name, tensor in result.items():
            if name in out:
                raise RemapError(f"keys collide on {name!r} when converting to the {to} layout")
            out[name] = tensor
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise RemapError(
            f"{len(unknown)} key(s) are not part of a {fam.name} checkpoint: {shown}; "
            "check that the file is a checkpoint of this model family"
        )
    return out


def dropped(changes: Iterable[tuple[str, str]], kept: Container[str] = ()) -> str:
    """The ``changes`` a remap recorded (each source key it dropped, or changed by a named value operation), block
    numbers as ``N`` with a count, leaving out the keys in ``kept`` (a layout's computed buffers, written again):
    ``''`` for none."""
    found: dict[str, int] = {}
    for key, op in changes:
        if key not in kept:
            name = re.sub(r"\.\d+\.", ".N.", key) + (f" ({op})" if op else "")
            found[name] = found.get(name, 0) + 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(found.items()))


def to_layerscale(
    state_dict: Mapping[str, V], family: str | Family = "cait", changes: list[tuple[str, str]] | None = None
) -> dict[str, V]:
    """A state dict in any accepted layout (prefixes stripped, wrappers already removed) in the ``ls``
    layout, the same tensors in source order; idempotent. ``changes``, where given, gets each source key dropped
    or changed by a value operation, with the operation's name (:func:`dropped` words them).

    Raises:
        RemapError: A key is not covered by the family's rules, or keys collide.
    """
    return _remap(state_dict, family, "ls", changes)


def remap(state_dict: Mapping[str, V], family: str | Family, to: str) -> dict[str, V]:
    """An ``ls``-layout state dict in another of its family's layouts (``"transformers"``), by the family's rules.

    Raises:
        RemapError: The family has no such layout, a key is not covered by its rules, or keys collide.
    """
    return _remap(state_dict, family, to)


def to_gamma(state_dict: Mapping[str, V], family: str | Family = "cait") -> dict[str, V]:
    """The inverse of :func:`to_layerscale`: ``to_gamma(to_layerscale(sd)) == sd`` for a prefix-free
    official state dict, key for key and tensor for tensor.

    Raises:
        RemapError: A key is not covered by the family's rules, or keys collide.
    """
    return _remap(state_dict, family, "gamma")


def _shape(t: Any) -> list[int]:
    return list(t) if isinstance(t, (tuple, list)) else list(getattr(t, "shape", []))


def mismatches(state_dict: Mapping[str, Any], expected: Mapping[str, Any], limit: int = 5) -> tuple[int, str]:
    """How many keys of ``state_dict`` are missing, unexpected or mis-shaped against ``expected``
    (keys to tensors or shapes), and the first ``limit`` of each kind with their shapes."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    common = [k for k in expected if k in state_dict]
    misshaped = [k for k in common if _shape(state_dict[k]) != _shape(expected[k])]
    parts = []
    for what, keys, show in (
        ("missing", missing, lambda k: f"{k} {_shape(expected[k])}"),
        ("unexpected", unexpected, lambda k: f"{k} {_shape(state_dict[k])}"),
        ("mis-shaped", misshaped, lambda k: f"{k} {_shape(state_dict[k])} != {_shape(expected[k])}"),
    ):
        if keys:
            parts.append(
                f"{len(keys)} {what} ({', '.join(map(show, keys[:limit]))}{', ...' if len(keys) > limit else ''})"
            )
    return len(missing) + len(unexpected) + len(misshaped), "; ".join(parts)


def check_state_dict(state_dict: Mapping[str, Any], expected: Mapping[str, Any], what: str = "model") -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` listing :func:`mismatches` unless there are none."""
    count, detail = mismatches(state_dict, expected)
    if count:
        raise RemapError(f"checkpoint does not fit {what}: {detail}")


def check_floating(state_dict: Mapping[str, Any], what: str = "model", limit: int = 5) -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` naming the tensors that are not floating point,
    as every weight and buffer of these models is."""
    bad = [(k, v.dtype) for k, v in state_dict.items() if not v.is_floating_point()]
    if bad:
        shown = ", ".join(f"{k} is {str(dtype).removeprefix('torch.')}" for k, dtype in bad[:limit])
        raise RemapError(
            f"checkpoint does not fit {what}: {len(bad)} tensor(s) not floating point ({shown}"
            f"{', ...' if len(bad) > limit else ''}); every weight must be float32, bfloat16 or float16, "
            "check how the file was written"
        )
