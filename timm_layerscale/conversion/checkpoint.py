"""The state dict inside a checkpoint as saved: training wrappers (``{'model': ...}``, EMA, DINO's ``'teacher'``),
prefixes (``module.``, ``_orig_mod.``, a wrapping module's name) and DINOv2's chunked blocks taken off, and the
container they made. No I/O; the tensors pass through unchanged."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import RemapError, option
from ..families import FAMILIES, model_holders

__all__ = ["EMA_KEYS", "WRAPPER_KEYS", "container_of", "state_dict_of", "strip_prefixes"]
__all__ += ["unwrap_state_dict"]

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


def container_of(checkpoint: Mapping[str, Any], ema: bool = False) -> tuple[str | None, str]:
    """``(wrapper, prefix)`` of a checkpoint: the key its state dict is under (``None``: it is one) and the prefix
    every key of that has (``'module.'`` of DistributedDataParallel, or ``''``)."""
    inner = unwrap_state_dict(checkpoint, "model_ema" if ema else None)
    wrapper = next((k for k, v in checkpoint.items() if v is inner), None) if inner is not checkpoint else None
    prefix = next((p for p in PREFIXES if inner and all(k.startswith(p) for k in inner)), "")
    return wrapper, prefix


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
    whole model (a PyTorch Lightning module's ``model.``) where every key has it, and DINO's ``backbone.`` or a
    family's ``tower`` (PerceptionLM's vision tower) where other keys (the objective's heads, a language model, which
    the family's rules drop by name) lie beside it; then block chunks:
    DINOv2's training code nests its blocks as ``blocks.K.N.`` (``N`` the block's own index), read as ``blocks.N.``.

    Raises:
        RemapError: Two keys become one.
    """
    out = _renamed(state_dict, _strip)
    # a family's tower, wherever in the key it ends (PerceptionLM's model.vision_tower.timm_model.)
    towers = {k[: k.index(t) + len(t)] for k in out for f in FAMILIES.values() if (t := f.tower) and t in k}
    holders = list(towers) if len(towers) == 1 else model_holders(out)
    if len(holders) == 1 and (towers or holders[0] == BACKBONE or all(k.startswith(holders[0]) for k in out)):
        out = _renamed(out, lambda k: k.removeprefix(holders[0]))
    blocks = [k for k in out if k.startswith("blocks.")]
    if blocks and all(_CHUNKED.match(k) for k in blocks):
        out = _renamed(out, lambda k: _CHUNKED.sub(r"blocks.\1", k, count=1))
    return out


def state_dict_of(checkpoint: Mapping[str, Any], ema: bool = False) -> dict[str, Any]:
    """The state dict of a checkpoint, unwrapped (:func:`unwrap_state_dict`) and prefixes stripped."""
    return strip_prefixes(unwrap_state_dict(checkpoint, "model_ema" if ema else None))
