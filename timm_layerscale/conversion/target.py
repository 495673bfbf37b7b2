"""The tensors of a conversion: a source's, in its layout, read into the ``ls`` layout (zero optional biases left
out, gates folded where asked) and written into the target layout with the buffers its consumer stores. No I/O."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..families import Layout, Proof, Variant, state_dict_shapes
from .detect import without_zero_optional
from .fold import fold_state_dict
from .rules import Change, remap

__all__ = ["cast_tensors", "target_tensors"]


def target_tensors(
    tensors: Mapping[str, torch.Tensor],
    variant: Variant,
    source: Layout,
    to: Layout,
    fold: bool = False,
    dtype: torch.dtype | None = None,
    changes: list[Change] | None = None,
    written: list[Change] | None = None,
) -> dict[str, torch.Tensor]:
    """A source's tensors (in their ``source`` layout) mapped by the rules to layout ``to`` (folded with ``fold``, the
    folds rounded once to ``dtype``), with the buffers ``to`` stores; ``changes`` gets what reading became of each
    source key, ``written`` (default ``changes``) what writing made of each ``ls`` key. A layout written to itself
    keeps the source's stored values of what the rules drop and synthesise (rotary periods, masks, tokens: its
    consumer sees the same numbers), those that differ from what the rules would write recorded as
    ``"kept as stored"``."""
    family, written = variant.family, changes if written is None else written
    read: list[Change] = []
    ls = remap(tensors, source.read, f"{family.title} ({source.name} layout)", read)
    ls = without_zero_optional(ls, family, state_dict_shapes(variant), variant.name, read)
    if to is family.layouts["ls"]:
        if changes is not None:
            changes.extend(read)
        return fold_state_dict(ls, family, dtype) if fold else ls
    made: list[Change] = []
    out = remap(ls, to.write, f"{family.title} ({to.name} layout)", made)
    for key, value in (to.buffers(variant) if to.buffers else {}).items():  # what its consumer stores besides
        proof = value if isinstance(value, Proof) else Proof(value, "computed")
        out[key] = proof.tensor
        made.append((key, key, f"synthesised, {proof.why}"))
    if to is source:  # to itself: each key kept holds its stored value; only what is left out is said
        stored = {k: tensors[k] for k, t in out.items() if k in tensors and t is not tensors[k]}
        made = [(k, k, "kept as stored") for k, t in stored.items() if t.dtype != out[k].dtype or not t.equal(out[k])]
        read = [c for c in read if not c[1] and c[0].split("[")[0] not in out]  # a training head, say
        out.update(stored)
    if changes is not None:
        changes.extend(read)
    if written is not None:
        written.extend(made)
    return out


def cast_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, keep: set[str]
) -> dict[str, torch.Tensor]:
    """``tensors`` with every floating-point one but those in ``keep`` (computed buffers, fp32 in every file) as
    ``dtype`` (``None``: as they are)."""
    return {k: v.to(dtype) if dtype and v.is_floating_point() and k not in keep else v for k, v in tensors.items()}
