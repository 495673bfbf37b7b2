"""LayerScale: a learnable per-channel gate on residual-branch outputs.

A transformer block with LayerScale computes, for a token stream ``x`` of shape
``(B, N, C)``::

    x = x + ls1(attn(norm1(x)))      # ls1(y) = y * gamma_1
    x = x + ls2(mlp(norm2(x)))       # ls2(y) = y * gamma_2

Reference: Touvron et al., "Going deeper with Image Transformers", ICCV 2021
(arXiv 2103.17239), section 2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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

    **Operation.** LayerScale is the diagonal linear map ``diag(gamma)`` applied to the
    output ``f(norm(x))`` of a residual branch before it is added back to the stream::

        x = x + diag(gamma) @ f(norm(x))     # per token
        out[..., c] = x[..., c] * gamma[c]   # for c in 0 .. C-1: what forward computes

    It has ``C`` parameters, against the ``C^2`` of a full linear layer, and is applied
    once per residual branch (``ls1`` after attention, ``ls2`` after the MLP).

    **Training dynamics.** With every ``gamma`` small at initialisation, each block
    starts close to the identity: the residual stream is dominated by the patch
    embedding and every branch adds only a little, whatever the depth. Gradients still
    reach every branch (the gate scales them by ``gamma``, it does not block them),
    and each channel learns its own gate, so branches are switched on channel by channel
    as training needs them. This is what let CaiT train stably beyond depth 24, where
    plain pre-norm ViTs (and a scalar gate, as in ReZero or SkipInit) stop improving.

    **Init choices.** ``init_value`` is the value of every element of ``gamma`` after
    :meth:`reset_parameters`:

    - the paper's rule by depth, :func:`cait_init_value`: 0.1 up to 18 blocks, 1e-5 up
      to 24, 1e-6 beyond (the models here build with ``init_values="auto"`` to use it);
    - 1e-4 (the default here), used by DeiT III and ViT-5;
    - the released CaiT checkpoints: 1e-5 (XXS, XS, S24) and 1e-6 (S36, M36, M48);
    - 1.0 turns the gate into the identity at the start, for fine-tuning a network
      trained without LayerScale.

    Weight decay is not applied to ``gamma``: a decayed gate is pulled towards 0,
    which switches its branch off. The parameter carries ``gamma._no_weight_decay = True``
    (kept through ``copy.deepcopy``, ``to_empty`` and ``load_state_dict(assign=True)``)
    and :func:`param_groups` honours it.

    **Shapes and dtypes.** ``gamma`` has shape ``(C,)`` and broadcasts over every
    leading axis, so inputs of shape ``(B, N, C)``, ``(B, H, W, C)`` or
    ``(B, T, H, W, C)`` all work. The output has the shape and dtype of the input:
    a bf16/fp16 input with an fp32 ``gamma`` returns bf16/fp16 (``gamma`` is cast to
    the input's dtype first, then one elementwise multiply). With ``promote=True`` the
    multiply follows PyTorch's type promotion instead (``x * gamma``: a bf16 input with
    an fp32 ``gamma`` gives an fp32 product, rounded once), which is what the official
    CaiT and ViT-5 blocks (``gamma_1 * x``) and timm's own LayerScale compute. The
    blocks of this package's models build with ``promote=True``, so under
    ``torch.autocast`` they compute exactly what their references compute.

    **Cost.** :meth:`flop_count`: one multiplication per element, ``N * C`` for ``N``
    tokens. For deployment, :func:`~timm_layerscale.conversion.fold.fold_layerscale` folds ``gamma``
    into the linear layer before it and removes the module.

    Args:
        dim: Number of channels ``C``; the size of the input's last dimension, >= 1.
        init_value: Initial value of every element of ``gamma``.
        promote: Multiply with type promotion (output in the wider of the two dtypes)
            instead of casting ``gamma`` to the input's dtype.
        device: Device on which ``gamma`` is created (``"meta"`` allowed).
        dtype: dtype of ``gamma``.

    Attributes:
        gamma: The learned gate, an ``nn.Parameter`` of shape ``(C,)``; in a state dict
            it is ``<module>.gamma`` (``blocks.N.ls1.gamma``), where the official
            checkpoints keep ``blocks.N.gamma_1``.
        dim: ``C``.
        init_value: The value ``gamma`` is reset to.

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
        self._retag()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale the last dimension of ``x`` by ``gamma``.

        Args:
            x: Tensor of shape ``(..., C)``: ``(B, N, C)`` tokens in a transformer
                block, ``(B, H, W, C)`` channels-last feature maps; any float dtype.

        Returns:
            Tensor of the same shape, ``out[..., c] = x[..., c] * gamma[c]``; of the
            input's dtype, or with ``promote`` the promoted dtype of input and ``gamma``.

        Raises:
            ValueError: ``x.shape[-1] != C``, when run eagerly (in a TorchScript or FX graph
                the multiply fails instead, unless the last dimension is 1 and broadcasts).
        """
        if not torch.jit.is_scripting():  # noqa: SIM102  (TorchScript skips this branch only when the test is alone)
            if not isinstance(x, torch.fx.Proxy) and x.shape[-1] != self.dim:  # an FX trace's shapes are symbols
                raise ValueError(f"LayerScale expected an input whose last dimension is {self.dim}, got {x.shape[-1]}")
        return x * self.gamma if self.promote else x * self.gamma.to(x.dtype)

    def flop_count(self, num_tokens: int) -> int:
        """Multiplications of one forward pass over ``num_tokens`` tokens.

        Args:
            num_tokens: Number of ``C``-vectors scaled: ``B * N`` for a ``(B, N, C)``
                input (``B * H * W`` for ``(B, H, W, C)``).

        Returns:
            ``num_tokens * C``: one multiplication per element, no additions.
        """
        return int(num_tokens) * self.dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}, init_value={self.init_value:g}" + (", promote=True" if self.promote else "")

    # The no-weight-decay tag is a plain attribute of the Parameter object. Operations
    # that replace the Parameter (deepcopy, to_empty, load_state_dict(assign=True))
    # create a fresh object without it, so it is restored after each of them.
    def _retag(self) -> None:
        _tag_no_weight_decay(self._parameters.get("gamma"))

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

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "gamma":
            self._retag()


def layer_scale_or_identity(dim: int, init_values: float | None, promote: bool = False, **dd: Any) -> nn.Module:
    """A :class:`LayerScale` of ``dim`` channels, or ``nn.Identity`` when ``init_values`` is ``None``."""
    return LayerScale(dim, init_values, promote, **dd) if init_values is not None else nn.Identity()


def cait_init_value(depth: int) -> float:
    """LayerScale initial value for a network of ``depth`` blocks, by the CaiT rule.

    The rule of "Going deeper with Image Transformers": 0.1 for depth up to 18,
    1e-5 up to 24, 1e-6 beyond. The released CaiT checkpoints used 1e-5 for the
    XXS36 models; the registered variants keep their released values.

    Args:
        depth: Total number of blocks (self-attention blocks), >= 1.

    Returns:
        The initial value of every ``gamma`` element.

    Raises:
        ValueError: ``depth`` < 1.

    Example:
        >>> from timm_layerscale import cait_init_value
        >>> [cait_init_value(d) for d in (12, 18, 24, 36)]
        [0.1, 0.1, 1e-05, 1e-06]
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
        if getattr(param, NO_WEIGHT_DECAY_ATTR, False) or name in skip or param.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]
