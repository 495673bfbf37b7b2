"""Folding LayerScale into the linear layer before it, for deployment: ``gamma * (W x + b)`` is
``(diag(gamma) W) x + gamma * b``, one elementwise pass fewer per branch. Dropout and stochastic depth
between the two commute with the per-channel scale, so the folded model computes the same function in
train mode too (training it further is another parameterisation)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..families import GATE_KEY
from ..layer_scale import FOLD_TARGETS, fold_block, fold_plan, fold_weights

__all__ = ["fold_layerscale", "fold_state_dict"]


def fold_state_dict(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every ``*.ls1.gamma`` / ``*.ls2.gamma`` of an ``ls``-layout state dict folded into ``attn.proj`` /
    ``mlp.fc2`` (``layer_scale.fold_weights``, the rule the modules fold by, rounded once to ``dtype``, default the
    layer's) and dropped.

    Raises:
        ValueError: A gate without its linear layer, or of another width.
    """
    out = dict(state_dict)
    for key in [k for k in state_dict if (m := GATE_KEY.fullmatch(k)) and m["ls"]]:
        block, gate, _ = key.rsplit(".", 2)
        target = ".".join((block, *FOLD_TARGETS[gate]))
        weight, gamma = out.get(f"{target}.weight"), out.pop(key)
        if weight is None or weight.shape[2:] not in ((), (1, 1)) or weight.shape[0] != gamma.shape[0]:
            found = "nothing" if weight is None else f"a weight of shape {tuple(weight.shape)}"
            raise ValueError(
                f"cannot fold {key!r} (shape {tuple(gamma.shape)}): expected a linear weight at {target!r}, found {found}"
            )
        out[f"{target}.weight"], bias = fold_weights(weight, out.get(f"{target}.bias"), gamma, dtype)
        if bias is not None:
            out[f"{target}.bias"] = bias
    return out


def fold_layerscale(model: nn.Module) -> nn.Module:
    """Fold every ``ls1`` / ``ls2`` gate of ``model`` into the linear layer before it, in place: this package's
    blocks (as ``timm.utils.reparameterize_model`` does through their ``reparameterize()``) and timm's own
    LayerScale blocks (ViT, DeiT-III). Every block is checked before anything changes. The folded model
    computes the same function up to rounding (fp32: within 1e-5); its state dict loads into the model built
    with ``folded_layerscale=True``.

    Raises:
        ValueError: A block's gate has no ``nn.Linear`` of its width to fold into; the model is unchanged.
    """
    plans = []
    for prefix, block in model.named_modules():
        try:
            plans.append((block, fold_plan(block)))
        except ValueError as e:
            raise ValueError(f"{prefix or 'the model'}: {e}") from None
    for block, plan in plans:
        if plan:
            fold_block(block, plan)
    return model
