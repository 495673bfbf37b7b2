"""Multi-head attention: the head geometry, projections and dropouts every attention layer here shares.

:class:`MultiHeadAttention` splits ``C`` channels into ``H`` heads of width
``d = C / H`` and builds the input projections, the attention dropout and the output
projection; a subclass says how the heads attend. :class:`SdpaAttention` attends with
``softmax(q k^T / sqrt(d)) v``, through ``F.scaled_dot_product_attention`` when timm's
fused attention is switched on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MultiHeadAttention", "SdpaAttention"]


class MultiHeadAttention(nn.Module):
    """Base of the attention layers: ``C`` channels as ``H`` heads of width ``d = C / H``.

    Builds, in this order: the input projections (:meth:`_build_qkv`; one ``qkv``
    linear ``C -> 3C`` unless a subclass makes others), ``attn_drop``, the output
    projection ``proj``, what the heads attend with (:meth:`_build_attend`, the
    subclass's) and ``proj_drop``. A subclass computes the attention in ``forward``
    and ends with :meth:`_project`.

    Args:
        dim: Token width ``C``; divisible by ``num_heads``.
        num_heads: Heads ``H``.
        qkv_bias: Bias on the input projections.
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
        device: Device to build on.
        dtype: Parameter dtype.
        **qkv_args: Passed on to :meth:`_build_qkv` (for subclasses whose input
            projections take options).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        device: Any = None,
        dtype: torch.dtype | None = None,
        **qkv_args: Any,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self._build_qkv(dim, qkv_bias, **qkv_args, **dd)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **dd)
        self._build_attend(**dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _build_qkv(self, dim: int, qkv_bias: bool, **dd: Any) -> None:
        """The input projections: one ``qkv`` linear ``C -> 3C``."""
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)

    def _build_attend(self, **dd: Any) -> None:
        """The layers or settings the heads attend with; each attention type has its own."""
        raise NotImplementedError

    def _split_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, N, C)`` to q, k and v stacked as ``(3, B, H, N, d)``."""
        B, N, _ = x.shape
        return self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Merged heads ``(B, N, C)`` through ``proj`` and ``proj_drop``."""
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class SdpaAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` whose heads attend as ``softmax(q k^T / sqrt(d)) v``.

    ``fused_attn`` (timm's ``use_fused_attn()`` when the layer is built) runs it as
    ``F.scaled_dot_product_attention``, else as explicit matmuls and softmax; the
    arguments are those of :class:`MultiHeadAttention`.
    """

    def _build_attend(self, **dd: Any) -> None:
        from timm.layers import use_fused_attn  # at build, not at import: timm's import registers the models

        self.fused_attn = use_fused_attn()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Args: q ``(B, H, M, d)``, k and v ``(B, H, N, d)``. Returns: ``(B, H, M, d)``."""
        if self.fused_attn:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        attn = self.attn_drop(attn)
        return attn @ v
