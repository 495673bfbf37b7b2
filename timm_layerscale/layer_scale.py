"""LayerScale: a learnable per-channel gate on residual-branch outputs.

Reference: Touvron et al., "Going deeper with Image Transformers", ICCV 2021
(arXiv 2103.17239), section 2.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["LayerScale", "layer_scale_or_identity", "cait_init_value", "param_groups", "NO_WEIGHT_DECAY_ATTR"]

#: Attribute set to ``True`` on parameters that must not receive weight decay.
NO_WEIGHT_DECAY_ATTR = "_no_weight_decay"


def _tag_no_weight_decay(param: torch.Tensor | None) -> None:
    if isinstance(param, torch.Tensor):
        setattr(param, NO_WEIGHT_DECAY_ATTR, True)


class LayerScale(nn.Module):
    """Learnable per-channel scaling of a residual branch, ``output = x * gamma``.

    LayerScale is a diagonal linear map ``diag(gamma)`` applied to the output of a
    residual branch before it is added back to the stream: ``C`` parameters instead
    of the ``C^2`` of a full linear layer. A small initial value (1e-4) suppresses the
    residual branches early in training, which lets deep networks (depth >= 24)
    train stably; 1e-5 was used for the deepest CaiT models. An initial value of 1.0
    effectively disables the gating, which suits fine-tuning from a strong
    checkpoint. Weight decay is not applied to ``gamma``: the parameter carries
    ``gamma._no_weight_decay = True`` and :func:`param_groups` honours it.

    ``gamma`` has shape ``(C,)`` and broadcasts over every leading axis, so inputs of
    shape ``(B, T, C)``, ``(B, H, W, C)`` or ``(B, T, H, W, C)`` all work. The output
    has the shape and dtype of the input: a bf16/fp16 input with an fp32 ``gamma``
    returns bf16/fp16.

    Args:
        dim: Number of channels ``C``; the size of the input's last dimension.
        init_value: Initial value of every element of ``gamma``.
        device: Device on which ``gamma`` is created (``"meta"`` allowed).
        dtype: dtype of ``gamma``.

    Raises:
        ValueError: In ``forward``, when the input's last dimension is not ``dim``.
    """

    def __init__(
        self,
        dim: int,
        init_value: float = 1e-4,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"LayerScale dim must be positive, got {dim}")
        dd = {"device": device, "dtype": dtype}
        self.dim = dim
        self.init_value = float(init_value)
        self.gamma = nn.Parameter(torch.empty(dim, **dd))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set every element of ``gamma`` to ``init_value``."""
        with torch.no_grad():
            self.gamma.fill_(self.init_value)
        self._retag()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale the last dimension of ``x`` by ``gamma``.

        Args:
            x: Tensor of shape ``(..., C)``.

        Returns:
            Tensor of the same shape and dtype, ``out[..., c] = x[..., c] * gamma[c]``.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(
                "LayerScale expected an input whose last dimension is {}, got {}".format(
                    self.dim, x.shape[-1]
                )
            )
        return x * self.gamma.to(x.dtype)

    def flop_count(self, num_tokens: int) -> int:
        """Multiplications of one forward pass over ``num_tokens`` tokens (``num_tokens * C``)."""
        return int(num_tokens) * self.dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}, init_value={self.init_value:g}"

    # The no-weight-decay tag is a plain attribute of the Parameter object. Operations
    # that replace the Parameter (deepcopy, to_empty, load_state_dict(assign=True))
    # create a fresh object without it, so it is restored after each of them.
    def _retag(self) -> None:
        _tag_no_weight_decay(self._parameters.get("gamma"))

    def _apply(self, fn: Any, recurse: bool = True) -> "LayerScale":
        out = super()._apply(fn, recurse)
        self._retag()
        return out

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._retag()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._retag()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "gamma":
            self._retag()


def layer_scale_or_identity(dim: int, init_values: float | None, **dd: Any) -> nn.Module:
    """A :class:`LayerScale` of ``dim`` channels, or ``nn.Identity`` when ``init_values`` is ``None``."""
    return LayerScale(dim, init_values, **dd) if init_values is not None else nn.Identity()


def cait_init_value(depth: int) -> float:
    """LayerScale initial value for a network of ``depth`` blocks, by the CaiT rule.

    The rule of "Going deeper with Image Transformers": 0.1 for depth up to 18,
    1e-5 up to 24, 1e-6 beyond. The released CaiT checkpoints used 1e-5 for the
    XXS36 models; the registered variants keep their released values.

    Args:
        depth: Total number of blocks (self-attention blocks), >= 1.

    Returns:
        The initial value of every ``gamma`` element.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


def _no_decay_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for prefix, module in model.named_modules():
        fn = getattr(module, "no_weight_decay", None)
        if callable(fn) and not isinstance(module, LayerScale):
            for name in fn():
                names.add(f"{prefix}.{name}" if prefix else name)
        if isinstance(module, LayerScale):
            names.add(f"{prefix}.gamma" if prefix else "gamma")
    return names


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_weight_decay_list: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with weight decay off where it does not belong.

    A parameter goes into the no-decay group when any of these holds: it is tagged
    ``_no_weight_decay = True``; it is the ``gamma`` of a :class:`LayerScale`
    (found by module type, so an untagged gamma is still caught); its name is
    returned by ``no_weight_decay()`` of the model or of any submodule (names
    relative to that submodule); its name is in ``no_weight_decay_list``; or it is
    one-dimensional or a bias, timm's convention for norms and biases. Frozen
    parameters (``requires_grad=False``) are left out.

    Args:
        model: The model whose parameters are grouped.
        weight_decay: Decay of the decayed group.
        no_weight_decay_list: Extra parameter names to exempt.

    Returns:
        ``[{"params": [...], "weight_decay": 0.0}, {"params": [...], "weight_decay": weight_decay}]``,
        ready for ``torch.optim.AdamW(groups, ...)``.
    """
    skip = _no_decay_names(model) | set(no_weight_decay_list)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if (
            getattr(param, NO_WEIGHT_DECAY_ATTR, False)
            or name in skip
            or param.ndim <= 1
            or name.endswith(".bias")
        ):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]
