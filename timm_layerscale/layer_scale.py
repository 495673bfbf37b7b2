"""LayerScale, a learnable per-channel gate on a residual branch (Touvron et al., "Going deeper with Image
Transformers", ICCV 2021, arXiv 2103.17239), its initial value by depth, weight-decay groups, and folding
it into the linear layer before it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["LayerScale", "cait_init_value", "fold_block", "fold_plan", "fold_weights"]
__all__ += ["param_groups"]

#: Attribute set to ``True`` on parameters that must not receive weight decay.
NO_WEIGHT_DECAY_ATTR = "_no_weight_decay"


class LayerScale(nn.Module):
    """Learnable per-channel scaling of a residual branch, ``out[..., c] = x[..., c] * gamma[c]``.

    Args:
        dim: Channels ``C``, the size of the input's last dimension (at least 1).
        init_value: Every element of ``gamma`` after :meth:`reset_parameters`.
        promote: Multiply with type promotion (``x * gamma``: a bf16 input and an fp32 ``gamma`` give
            fp32), as the official blocks and timm's LayerScale do; else ``gamma`` is cast to the input's
            dtype. The models build with it, so that under autocast they compute what their references compute.
        device: Device of ``gamma`` (``"meta"`` allowed).
        dtype: dtype of ``gamma``.

    Attributes:
        gamma: ``nn.Parameter`` of shape ``(C,)``; ``blocks.N.ls1.gamma`` in a state dict, where the official
            checkpoints keep ``blocks.N.gamma_1``. It carries ``_no_weight_decay = True``, kept through
            ``copy.deepcopy``, ``to_empty`` and ``load_state_dict(assign=True)``, which :func:`param_groups` honours.

    Raises:
        ValueError: ``dim`` < 1; in ``forward``, an input whose last dimension is not ``dim``.

    Example:
        >>> import torch
        >>> from timm_layerscale import LayerScale
        >>> ls = LayerScale(4, init_value=1e-5)
        >>> ls
        LayerScale(dim=4, init_value=1e-05)
        >>> ls.gamma.shape, ls.gamma._no_weight_decay
        (torch.Size([4]), True)
        >>> x = torch.ones(2, 3, 4)               # (B, N, C)
        >>> ls(x).shape
        torch.Size([2, 3, 4])
        >>> torch.equal(ls(x), x * ls.gamma)
        True
        >>> ls(x.bfloat16()).dtype
        torch.bfloat16
        >>> ls.flop_count(num_tokens=3)           # N * C
        12
    """

    def __init__(
        self,
        dim: int,
        init_value: float = 1e-4,
        promote: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"LayerScale dim must be positive, got {dim}")
        self.dim = dim
        self.init_value = float(init_value)
        self.promote = promote
        self.gamma = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set every element of ``gamma`` to ``init_value``."""
        with torch.no_grad():
            self.gamma.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale the last dimension of ``x`` (``(..., C)``: ``(B, N, C)`` tokens, ``(B, H, W, C)`` maps) by ``gamma``.

        Returns:
            The same shape; the input's dtype, or with ``promote`` the promoted dtype of input and ``gamma``.
        """
        if not torch.jit.is_scripting():  # noqa: SIM102  (TorchScript skips the branch only when the test is alone)
            if not isinstance(x, torch.fx.Proxy) and x.shape[-1] != self.dim:  # an FX trace's shapes are symbols
                raise ValueError(f"LayerScale expected an input whose last dimension is {self.dim}, got {x.shape[-1]}")
        return x * self.gamma if self.promote else x * self.gamma.to(x.dtype)

    def flop_count(self, num_tokens: int) -> int:
        """Multiplications of one forward pass over ``num_tokens`` vectors of ``C`` (``B * N`` for ``(B, N, C)``)."""
        return int(num_tokens) * self.dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}, init_value={self.init_value:g}" + (", promote=True" if self.promote else "")

    # The tag is an attribute of the Parameter object; what replaces the object (deepcopy, to_empty,
    # load_state_dict(assign=True)) makes one without it, so each of them puts it back.
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "gamma" and isinstance(value, torch.Tensor):
            setattr(value, NO_WEIGHT_DECAY_ATTR, True)

    def _retag(self) -> None:
        if isinstance(gamma := self._parameters.get("gamma"), torch.Tensor):
            setattr(gamma, NO_WEIGHT_DECAY_ATTR, True)

    def _apply(self, fn: Any, recurse: bool = True) -> LayerScale:
        out = super()._apply(fn, recurse)
        self._retag()
        return out

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._retag()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._retag()


def cait_init_value(depth: int) -> float:
    """The CaiT paper's LayerScale initial value for ``depth`` blocks: 0.1 up to 18, 1e-5 up to 24, 1e-6 beyond.

    Example:
        >>> from timm_layerscale import cait_init_value
        >>> [cait_init_value(d) for d in (12, 18, 24, 36)]
        [0.1, 0.1, 1e-05, 1e-06]
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return 0.1 if depth <= 18 else 1e-5 if depth <= 24 else 1e-6


def param_groups(
    model: nn.Module, weight_decay: float, no_weight_decay_list: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Optimizer groups ``[{"params", "weight_decay": 0.0}, {"params", "weight_decay": weight_decay}]``: a
    trainable parameter is not decayed when tagged ``_no_weight_decay``, a :class:`LayerScale`'s ``gamma``,
    named by a ``no_weight_decay()`` or in ``no_weight_decay_list``, or one-dimensional or a bias (timm's rule)."""
    skip = set(no_weight_decay_list)
    for prefix, module in model.named_modules():
        names = ["gamma"] if isinstance(module, LayerScale) else getattr(module, "no_weight_decay", lambda: ())()
        skip |= {f"{prefix}.{name}" if prefix else name for name in names}
    groups: list[dict[str, Any]] = [{"params": [], "weight_decay": 0.0}, {"params": [], "weight_decay": weight_decay}]
    for name, p in model.named_parameters():
        if p.requires_grad:
            decayed = not (
                getattr(p, NO_WEIGHT_DECAY_ATTR, False) or name in skip or p.ndim <= 1 or name.endswith(".bias")
            )
            groups[decayed]["params"].append(p)
    return groups


@torch.no_grad()
def fold_weights(
    weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(diag(gamma) W, gamma * b)`` for a layer whose weight's first axis is its ``C`` outputs (a linear
    ``(C, C_in)``, a convolution's ``(C, C_in, k, k)``), bias ``(C,)`` and gamma ``(C,)``: the one folding rule,
    computed in at least float64 (where the product of two fp32 values is exact) and rounded once to ``dtype``
    (default the layer's): the same bits on any machine."""
    work = torch.float64
    g = gamma.detach().to(weight.device, work)
    w = (weight.detach().to(work) * g.reshape(-1, *[1] * (weight.ndim - 1))).to(dtype or weight.dtype)
    return w, None if bias is None else (bias.detach().to(work) * g).to(dtype or bias.dtype)


def fold_plan(block: nn.Module, gates: Iterable[Any]) -> list[tuple[str, Any, torch.Tensor]]:
    """The LayerScale modules (this package's or timm's) of ``block`` that its family's ``gates`` (``Gate`` records:
    ``name``, ``fold``, ``no_fold``) name, each with the layer it folds into and its ``gamma``.

    Raises:
        ValueError: A gate that cannot fold (its family's reason), or without a layer of its width to fold into.
    """
    from timm.layers import LayerScale as TimmLayerScale  # not at import: timm's import registers the models

    plan: list[tuple[str, Any, torch.Tensor]] = []
    for gate in gates:
        module = block._modules.get(gate.name)
        if not isinstance(module, (LayerScale, TimmLayerScale)):
            continue
        if not gate.fold:
            raise ValueError(f"cannot fold {gate.name}: {gate.no_fold}")
        try:
            layer: Any = block.get_submodule(gate.fold)
        except AttributeError:
            layer = None
        width = getattr(getattr(layer, "weight", None), "shape", (None,))[0]
        if width != module.gamma.shape[0]:
            found = f"{type(layer).__name__} of {width} outputs" if layer is not None else "nothing"
            raise ValueError(
                f"cannot fold {gate.name} (gamma of shape {tuple(module.gamma.shape)}): expected a layer of that "
                f"width at {gate.fold}, found {found}"
            )
        plan.append((gate.name, layer, module.gamma))
    return plan


@torch.no_grad()
def fold_block(block: nn.Module, plan: list[tuple[str, Any, torch.Tensor]]) -> None:
    """Fold the gates of ``block`` into the layers before them in place, each becoming ``nn.Identity``; ``plan`` is
    :func:`fold_plan`'s."""
    for name, linear, gamma in plan:
        weight, bias = fold_weights(linear.weight, linear.bias, gamma)
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
        setattr(block, name, nn.Identity())
