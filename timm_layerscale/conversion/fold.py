"""Folding LayerScale into the linear layer before it, for deployment: ``gamma * (W x + b)`` is
``(diag(gamma) W) x + gamma * b``, one elementwise pass fewer per branch. Dropout and stochastic depth
between the two commute with the per-channel scale, so the folded model computes the same function in
train mode too (training it further is another parameterisation)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import FoldError, option
from ..families import Family, gate_family, get_family
from ..layer_scale import fold_block, fold_plan, fold_weights

__all__ = ["fold_gates", "fold_layerscale", "fold_state_dict"]


def fold_state_dict(
    state_dict: Mapping[str, torch.Tensor], family: Family | str | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """:func:`fold_gates` of an ``ls``-layout state dict of ``family`` (a name; default the family whose gates its keys
    are)."""
    found = gate_family(state_dict) if family is None else get_family(family)
    return fold_gates(state_dict, found, dtype) if found else dict(state_dict)


def fold_gates(
    state_dict: Mapping[str, torch.Tensor], family: Family, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every gate of an ``ls``-layout state dict of ``family`` folded into the layer its
    :class:`~timm_layerscale.families.Gate` names (``layer_scale.fold_weights``, the rule the modules fold by, rounded
    once to ``dtype``, default the layer's) and dropped.

    Raises:
        FoldError: A gate that cannot fold (the family's reason), or without its layer, or of another width (a
            ``ValueError``).
    """
    out = dict(state_dict)
    for key in state_dict:
        found = family.gate_of(key)
        if found is None or found[2]:
            continue
        block, gate, _ = found
        if not gate.fold:
            raise FoldError(f"cannot fold {key!r}: {gate.no_fold}; leave out {option('fold')}")
        target = f"{block}.{gate.fold}"
        weight, gamma = out.get(f"{target}.weight"), out.pop(key)
        if weight is None or weight.shape[0] != gamma.shape[0]:
            found_there = "nothing" if weight is None else f"a weight of shape {tuple(weight.shape)}"
            raise FoldError(
                f"cannot fold {key!r} (shape {tuple(gamma.shape)}): expected a layer of that width at {target!r}, "
                f"found {found_there}"
            )
        out[f"{target}.weight"], bias = fold_weights(weight, out.get(f"{target}.bias"), gamma, dtype)
        if bias is not None:
            out[f"{target}.bias"] = bias
    return out


def fold_layerscale(model: nn.Module) -> nn.Module:
    """Fold every gate of ``model`` into the layer before it, in place: this package's blocks (as
    ``timm.utils.reparameterize_model`` does through their ``reparameterize()``) and timm's own LayerScale blocks
    (ViT, DeiT-III), by the gates of the family its state dict's keys are of. Every block is checked before anything
    changes. The folded model computes the same function up to rounding (fp32: within 1e-5); its state dict loads
    into the model built with ``folded_layerscale=True``.

    Raises:
        ValueError: A gate cannot fold (its family's reason) or has no layer of its width to fold into; the model is
            unchanged.
    """
    family = gate_family(model.state_dict())
    plans = []
    for prefix, block in model.named_modules():
        try:
            plans.append((block, fold_plan(block, family.gates if family else ())))
        except ValueError as e:
            raise ValueError(f"{prefix or 'the model'}: {e}") from None
    for block, plan in plans:
        if plan:
            fold_block(block, plan)
    return model
