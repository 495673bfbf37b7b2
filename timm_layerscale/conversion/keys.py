"""Pure key rules between checkpoint layouts.

Official CaiT/DeiT-III/ViT-5 checkpoints keep LayerScale as raw per-block parameters
``blocks.N.gamma_1`` / ``blocks.N.gamma_2``; this package (and timm's ViT/DeiT-III)
keeps it as a module, ``blocks.N.ls1.gamma`` / ``blocks.N.ls2.gamma``. This module maps
state dicts between the two layouts. It does no I/O and never touches tensor values:
tensors are passed through unchanged (same objects), so a lazily loaded checkpoint
stays lazy.

Each family (:mod:`timm_layerscale.families`) is an ordered table of rules. A source key is matched against the
rules in order; the first rule that matches decides: rename the key, keep it, or drop
it. A key no rule matches is an error that names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from ..errors import RemapError
from ..families import GATE_KEY, Family, Rule, get_family

__all__ = [
    "unwrap_state_dict",
    "strip_prefixes",
    "model_holders",
    "state_dict_of",
    "detect_layout",
    "to_layerscale",
    "to_gamma",
    "official_checkpoint",
    "check_floating",
    "check_state_dict",
    "WRAPPER_KEYS",
    "EMA_KEYS",
    "PREFIXES",
]

V = TypeVar("V")

#: Names of the EMA weights, the official DeiT / ViT-5 training code's first, then timm's train.py's.
EMA_KEYS = ("model_ema", "state_dict_ema")
_MAIN_KEYS = ("model", "state_dict", "module")  # DeepSpeed's model-states file uses 'module'
#: Keys that wrap a state dict inside a training checkpoint, in order of preference.
WRAPPER_KEYS = _MAIN_KEYS + EMA_KEYS
#: Prefixes added by DistributedDataParallel and torch.compile.
PREFIXES = ("module.", "_orig_mod.")


def official_checkpoint(state_dict: Mapping[str, V], family: str | Family) -> dict[str, Any]:
    """Wrap a ``gamma``-layout state dict the way the official training code saves it.

    ``{'model': {prefix + key: tensor}}``, where the prefix is the family's
    :attr:`~timm_layerscale.families.Family.official_prefix`: ``'module.'`` for CaiT (the official loader
    expects it), none for DeiT-III and ViT-5. Tensors are passed through.
    """
    fam = family if isinstance(family, Family) else get_family(family)
    return {"model": {fam.official_prefix + k: v for k, v in state_dict.items()}}


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(k, str) for k in obj)


def unwrap_state_dict(checkpoint: Mapping[str, Any], wrapper: str | None = None) -> Mapping[str, Any]:
    """Take the state dict out of a training checkpoint.

    Args:
        checkpoint: A state dict, or a dict holding one under ``'model'``,
            ``'state_dict'``, ``'module'``, ``'model_ema'`` or ``'state_dict_ema'``.
        wrapper: Which wrapper key to take. ``None`` takes the first of ``'model'``,
            ``'state_dict'`` and ``'module'``; the EMA weights must be asked for by name, and
            ``'model_ema'`` also finds them under timm's ``'state_dict_ema'``. A
            checkpoint that is already a state dict is returned as it is.

    Returns:
        The inner mapping of parameter names to tensors.

    Raises:
        RemapError: ``wrapper`` is named but absent, or the checkpoint holds only an
            EMA copy and none was asked for.
    """
    if not isinstance(checkpoint, Mapping):
        raise RemapError(f"checkpoint is a {type(checkpoint).__name__}, not a dict of tensors; save a state_dict()")
    if wrapper is not None:
        for key in EMA_KEYS if wrapper in EMA_KEYS else (wrapper,):
            if _is_state_dict(checkpoint.get(key)):
                return checkpoint[key]
        found = ", ".join(k for k in WRAPPER_KEYS if k in checkpoint) or "none"
        advice = "leave out ema=True" if wrapper in EMA_KEYS else "name a wrapper it has"
        raise RemapError(f"checkpoint has no {wrapper!r} state dict (wrappers found: {found}); {advice}")
    for key in _MAIN_KEYS:
        if _is_state_dict(checkpoint.get(key)):
            return checkpoint[key]
    ema = [k for k in EMA_KEYS if _is_state_dict(checkpoint.get(k))]
    if ema and not any(hasattr(v, "shape") for v in checkpoint.values()):
        raise RemapError(f"checkpoint holds only an EMA state dict ({ema[0]!r}); ask for it explicitly: pass ema=True")
    return checkpoint


def strip_prefixes(state_dict: Mapping[str, V], prefixes: Iterable[str] = PREFIXES) -> dict[str, V]:
    """Remove DDP / torch.compile prefixes (``module.``, ``_orig_mod.``) from every key.

    Prefixes are removed repeatedly, so ``module._orig_mod.x`` becomes ``x``. Then the name of
    a module that wraps the whole model, as a PyTorch Lightning module's ``model.`` does, is
    removed too: the part before ``patch_embed.proj.weight`` (every family has that key), where
    every key starts with it.
    """
    prefixes = tuple(prefixes)
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        new = key
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if new.startswith(p):
                    new = new[len(p) :]
                    changed = True
        if new in out:
            raise RemapError(f"two keys become {new!r} once prefixes are removed; the checkpoint is ambiguous")
        out[new] = value
    holders = model_holders(out)
    if len(holders) == 1 and all(k.startswith(holders[0]) for k in out):
        return {k.removeprefix(holders[0]): v for k, v in out.items()}
    return out


def model_holders(keys: Iterable[str]) -> list[str]:
    """The names of the modules that hold a model among ``keys``, sorted: ``'model.'`` for
    ``model.patch_embed.proj.weight`` (a key every family has)."""
    return sorted(k.removesuffix("patch_embed.proj.weight") for k in keys if k.endswith(".patch_embed.proj.weight"))


def state_dict_of(checkpoint: Mapping[str, Any], ema: bool = False) -> dict[str, Any]:
    """The state dict of a checkpoint: unwrapped (:func:`unwrap_state_dict`), prefixes stripped.

    Args:
        checkpoint: A state dict or a training checkpoint holding one.
        ema: Take the EMA weights (``'model_ema'`` or timm's ``'state_dict_ema'``).
    """
    return strip_prefixes(unwrap_state_dict(checkpoint, "model_ema" if ema else None))


def detect_layout(state_dict: Mapping[str, Any]) -> str:
    """Say which LayerScale layout a (prefix-free) state dict uses (any family).

    Returns:
        ``"gamma"`` (official ``gamma_1``/``gamma_2``), ``"ls"`` (``ls1.gamma``), or
        ``"none"`` when it holds no LayerScale parameters at all.

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


def _apply_rules(state_dict: Mapping[str, V], rules: tuple[Rule, ...], family: str, direction: str) -> dict[str, V]:
    out: dict[str, V] = {}
    unknown: list[str] = []
    for key, value in state_dict.items():
        for rule in rules:
            matched, new_key = rule.apply(key)
            if matched:
                break
        else:
            unknown.append(key)
            continue
        if new_key is None:
            continue
        if new_key in out:
            raise RemapError(f"keys collide on {new_key!r} when converting to the {direction} layout")
        out[new_key] = value
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise RemapError(
            f"{len(unknown)} key(s) are not part of a {family} checkpoint: {shown}; "
            "check that the file is a checkpoint of this model family"
        )
    return out


def to_layerscale(state_dict: Mapping[str, V], family: str | Family = "cait") -> dict[str, V]:
    """Map a state dict in any accepted layout to this package's ``ls`` layout.

    Prefixes (``module.``, ``_orig_mod.``) are stripped first; wrappers must already
    be removed (:func:`unwrap_state_dict`). Keys already in the ``ls`` layout pass
    through, so the function is idempotent.

    Args:
        state_dict: Mapping of parameter names to tensors (values are not touched).
        family: Family name or :class:`~timm_layerscale.families.Family`.

    Returns:
        A new dict in the ``ls`` layout, same tensor objects, source key order.

    Raises:
        RemapError: A key is not covered by the family's rules, or keys collide.
    """
    return _remap(state_dict, family, "ls")


def to_gamma(state_dict: Mapping[str, V], family: str | Family = "cait") -> dict[str, V]:
    """Map a state dict in the ``ls`` layout back to the official ``gamma`` layout.

    The inverse of :func:`to_layerscale`: ``to_gamma(to_layerscale(sd)) == sd`` for a
    prefix-free official state dict, key for key and tensor for tensor. Keys already
    in the ``gamma`` layout pass through.

    Raises:
        RemapError: A key is not covered by the family's rules, or keys collide.
    """
    return _remap(state_dict, family, "gamma")


def _remap(state_dict: Mapping[str, V], family: str | Family, to: str) -> dict[str, V]:
    fam = get_family(family) if isinstance(family, str) else family
    sd = strip_prefixes(state_dict)
    detect_layout(sd)
    if to == "ls":
        return _apply_rules(sd, fam.to_layerscale, fam.name, "LayerScale-module")
    return _apply_rules(sd, fam.to_gamma, fam.name, "gamma")


def _shape(t: Any) -> tuple[int, ...] | None:
    s = getattr(t, "shape", None)
    return tuple(s) if s is not None else None


def check_state_dict(
    state_dict: Mapping[str, Any],
    expected: Mapping[str, Any],
    what: str = "model",
    limit: int = 5,
) -> None:
    """Check that a state dict has exactly the expected keys and shapes.

    Args:
        state_dict: The converted state dict (values with a ``.shape``).
        expected: Target keys to tensors or shapes (e.g. ``model.state_dict()`` of a
            model built on the ``meta`` device).
        what: Name of the target, used in the message.
        limit: How many keys of each kind of mismatch the message shows.

    Raises:
        RemapError: One error listing the first ``limit`` missing, unexpected and
            mis-shaped keys (with shapes) and the count of each.
    """
    exp = {k: tuple(v) if isinstance(v, (tuple, list)) else _shape(v) for k, v in expected.items()}
    missing = [k for k in exp if k not in state_dict]
    unexpected = [k for k in state_dict if k not in exp]
    misshaped = [(k, _shape(state_dict[k]), exp[k]) for k in exp if k in state_dict and _shape(state_dict[k]) != exp[k]]
    if not (missing or unexpected or misshaped):
        return
    parts = []
    if missing:
        shown = ", ".join(f"{k} {list(exp[k] or [])}" for k in missing[:limit])
        parts.append(f"{len(missing)} missing ({shown}{', ...' if len(missing) > limit else ''})")
    if unexpected:
        shown = ", ".join(f"{k} {list(_shape(state_dict[k]) or [])}" for k in unexpected[:limit])
        parts.append(f"{len(unexpected)} unexpected ({shown}{', ...' if len(unexpected) > limit else ''})")
    if misshaped:
        shown = ", ".join(f"{k} {list(a or [])} != {list(b or [])}" for k, a, b in misshaped[:limit])
        parts.append(f"{len(misshaped)} mis-shaped ({shown}{', ...' if len(misshaped) > limit else ''})")
    raise RemapError(f"checkpoint does not fit {what}: " + "; ".join(parts))


def check_floating(state_dict: Mapping[str, Any], what: str = "model", limit: int = 5) -> None:
    """Check that every tensor of a state dict is floating point, as every weight and buffer of these models is.

    Args:
        state_dict: Name to tensor.
        what: Name of the target, used in the message.
        limit: How many tensors the message names.

    Raises:
        RemapError: Naming the first ``limit`` other tensors with their dtypes, and the count.
    """
    bad = [(k, v.dtype) for k, v in state_dict.items() if hasattr(v, "is_floating_point") and not v.is_floating_point()]
    if not bad:
        return
    shown = ", ".join(f"{k} is {str(dtype).removeprefix('torch.')}" for k, dtype in bad[:limit])
    raise RemapError(
        f"checkpoint does not fit {what}: {len(bad)} tensor(s) not floating point ({shown}"
        f"{', ...' if len(bad) > limit else ''}); every weight must be float32, bfloat16 or float16, "
        "check how the file was written"
    )
