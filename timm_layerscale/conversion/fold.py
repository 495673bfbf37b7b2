"""Fold LayerScale into the linear layer before it, for deployment.

A residual branch ending in a linear layer and LayerScale computes
``gamma * (W x + b) = (diag(gamma) W) x + gamma * b``: the gate is a linear layer with
rows scaled by ``gamma``. Folding removes one elementwise pass per branch at inference
time. Dropout and stochastic depth between the two commute with the per-channel scale,
so the folded model computes the same function in train mode too; training it further
is another parameterisation, though (no separate, undecayed ``gamma``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..families import FOLD_TARGETS, GATE_KEY
from ..layer_scale import LayerScale

__all__ = ["fold_layerscale", "fold_state_dict", "fold_weights"]


def _is_layerscale(module: nn.Module) -> bool:
    # this package's LayerScale or timm's: both scale by a per-channel ``gamma``
    from timm.layers import LayerScale as TimmLayerScale  # not at import: the models import this module

    return isinstance(module, (LayerScale, TimmLayerScale))


def _target_linear(parent: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    module: nn.Module | None = parent
    for name in path:
        module = getattr(module, name, None) if isinstance(module, nn.Module) else None
    return module


@torch.no_grad()
def fold_weights(
    weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(diag(gamma) W, gamma * b)``: the one folding rule, used for modules and state dicts alike.

    Computed in at least fp32 and rounded once to the weight's (and bias's) dtype.

    Args:
        weight: Linear weight ``(C_out, C_in)``.
        bias: Linear bias ``(C_out,)`` or ``None``.
        gamma: LayerScale ``(C_out,)``.

    Returns:
        The folded weight and bias (new tensors).
    """
    work = torch.promote_types(weight.dtype, torch.float32)
    g = gamma.detach().to(weight.device, work)
    w = (weight.detach().to(work) * g[:, None]).to(weight.dtype)
    b = None if bias is None else (bias.detach().to(work) * g).to(bias.dtype)
    return w, b


@torch.no_grad()
def _fold(linear: nn.Linear, gamma: torch.Tensor) -> None:
    w, b = fold_weights(linear.weight, linear.bias, gamma)
    linear.weight.copy_(w)
    if b is not None:
        linear.bias.copy_(b)


def fold_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold every ``*.ls1.gamma`` / ``*.ls2.gamma`` of an ``ls``-layout state dict into its linear layer.

    The state-dict twin of :func:`fold_layerscale` (same :func:`fold_weights`, so the
    two give identical tensors): ``ls1.gamma`` goes into ``attn.proj``, ``ls2.gamma``
    into ``mlp.fc2``, and the gammas are dropped. A state dict without gammas comes
    back unchanged.

    Raises:
        ValueError: A gamma without its linear layer, or of another width.
    """
    out = dict(state_dict)
    for key in [k for k in state_dict if (m := GATE_KEY.fullmatch(k)) and m["l"]]:
        prefix, ls_name, _ = key.rsplit(".", 2)
        target = ".".join((prefix, *FOLD_TARGETS[ls_name]))
        weight = out.get(f"{target}.weight")
        gamma = out.pop(key)
        if weight is None or weight.ndim != 2 or weight.shape[0] != gamma.shape[0]:
            found = "nothing" if weight is None else f"a weight of shape {tuple(weight.shape)}"
            raise ValueError(
                f"cannot fold {key!r} (shape {tuple(gamma.shape)}): expected a linear weight at {target!r}, found {found}"
            )
        w, b = fold_weights(weight, out.get(f"{target}.bias"), gamma)
        out[f"{target}.weight"] = w
        if b is not None:
            out[f"{target}.bias"] = b
    return out


def fold_layerscale(model: nn.Module) -> nn.Module:
    """Fold every ``ls1`` / ``ls2`` LayerScale into the linear layer before it, in place.

    For each module with LayerScale children ``ls1`` / ``ls2`` (CaiT's self- and
    class-attention blocks, ViT-5 blocks, timm's ViT / DeiT-III blocks), ``ls1.gamma``
    is folded into ``attn.proj`` and ``ls2.gamma`` into ``mlp.fc2``
    (``W' = diag(gamma) W``, ``b' = gamma * b``, computed in at least fp32 and cast
    back to the layer's dtype), and the LayerScale is replaced by ``nn.Identity``. The
    result computes the same function up to rounding (fp32: within 1e-5) and its state
    dict loads into the model built with ``folded_layerscale=True``. Every block is
    checked before anything changes, so a failure leaves the model untouched. A model
    without LayerScale is returned as it is.

    Args:
        model: The model; modified in place. ``model.folded_layerscale`` is set to
            ``True`` when the model has that attribute.

    Returns:
        ``model``.

    Raises:
        ValueError: A block has LayerScale but no ``nn.Linear`` to fold it into, or
            the linear layer's output width is not the LayerScale's width.
    """
    plan: list[tuple[nn.Module, str, nn.Linear, torch.Tensor]] = []
    for prefix, parent in model.named_modules():
        for ls_name, path in FOLD_TARGETS.items():
            ls = parent._modules.get(ls_name)
            if ls is None or not _is_layerscale(ls):
                continue
            where = f"{prefix}.{ls_name}" if prefix else ls_name
            target = ".".join((prefix, *path)) if prefix else ".".join(path)
            linear = _target_linear(parent, path)
            if not isinstance(linear, nn.Linear):
                found = "nothing" if linear is None else type(linear).__name__
                raise ValueError(
                    f"cannot fold LayerScale {where!r}: expected an nn.Linear at {target!r}, found {found}"
                )
            gamma = ls.gamma
            if gamma.ndim != 1 or gamma.shape[0] != linear.out_features:
                raise ValueError(
                    f"cannot fold LayerScale {where!r} (gamma of shape {tuple(gamma.shape)}) into "
                    f"{target!r} with {linear.out_features} outputs"
                )
            plan.append((parent, ls_name, linear, gamma))
    for parent, ls_name, linear, gamma in plan:
        _fold(linear, gamma)
        setattr(parent, ls_name, nn.Identity())
    inner = getattr(model, "_orig_mod", model)
    if hasattr(inner, "folded_layerscale"):
        inner.folded_layerscale = True
    return model
