"""Value operations that several families' rules share: fused and split projections, synthesised tokens, and the
drops of tensors unused at inference; torch is imported only when one runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import RemapError
from . import Proof, Rule

__all__ = ["TRAINING_HEADS", "UNUSED", "fuse_qkv", "no_head", "split_qkv", "training_heads", "zeros_like_token"]

#: The self-supervised objective's heads beside the backbone in a training checkpoint (``teacher_checkpoint.pth``).
TRAINING_HEADS = r"(?:dino_head|ibot_head)\..+"
#: The proof of a dropped tensor that the model's forward pass at inference never reads.
UNUSED = "unused at inference"


def training_heads() -> Rule:
    """The rule dropping a training checkpoint's objective heads, which the official evaluation code leaves out."""
    return Rule(TRAINING_HEADS, None, why="training head")


def fuse_qkv(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Separate q, k and v projection weights ``(C, C)`` each as one fused ``qkv`` weight ``(3C, C)`` at ``target``:
    the q key's operation concatenates the three (a copy); the k and v keys' give nothing.

    Raises:
        RemapError: The q key's k or v partner is missing.
    """
    for q, k, v in (("q_proj", "k_proj", "v_proj"), ("query", "key", "value")):
        if f".{q}." in key:
            parts = [key, key.replace(f".{q}.", f".{k}."), key.replace(f".{q}.", f".{v}.")]
            missing = [p for p in parts if p not in state_dict]
            if missing:
                raise RemapError(f"checkpoint has {key!r} but not {', '.join(missing)}; q, k and v come together")
            import torch

            return {target: torch.cat([state_dict[p] for p in parts])}
    return {}  # the k or v key: taken by the q key's operation


def split_qkv(names: tuple[str, str, str]) -> Callable[[str, Any, str, Mapping[str, Any]], dict[str, Any]]:
    """The inverse of :func:`fuse_qkv`: a fused weight or bias ``(3C, ...)`` as three (views), at ``target`` plus
    each of ``names``."""

    def split_qkv(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        return {target.format(name): part for name, part in zip(names, tensor.chunk(3), strict=True)}

    return split_qkv


def zeros_like_token(shape: Callable[[Any], tuple[int, ...]], name: str) -> Callable[..., dict[str, Any]]:
    """A rule's operation keeping a token and synthesising ``name``, zeros of ``shape(token)`` (a mask token of a
    layout that stores one but never uses it at inference)."""

    def with_unused_token(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        return {target: tensor, name: Proof(torch.zeros(shape(tensor), dtype=tensor.dtype), f"zeros, {UNUSED}")}

    return with_unused_token


def no_head(model: str) -> Callable[..., dict[str, Any]]:
    """The operation on a classifier's key for a layout whose ``model`` has none: a one-line error."""

    def no_head(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        raise RemapError(f"{model} has no classifier to hold {key!r}; convert to another layout, or the backbone")

    return no_head
