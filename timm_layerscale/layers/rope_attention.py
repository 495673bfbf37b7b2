"""Self-attention with QK-norm and 2-D rotary embedding on q and k (ViT-5), and its block."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from .attention import SdpaAttention
from .block import PreNormBlock
from .rope import RopeTables, apply_rope

__all__ = ["Vit5Attention", "Vit5Block", "rms_norm"]


def rms_norm() -> Callable[..., nn.Module]:
    """ViT-5's norm: timm's ``RmsNorm`` with eps 1e-6."""
    from timm.layers import RmsNorm  # at build, not at import: timm's import registers the models

    return partial(RmsNorm, eps=1e-6)


class Vit5Attention(SdpaAttention):
    """Multi-head self-attention with QK RMSNorm and rotary embedding on q and k.

    Args:
        dim: Token width ``C``; divisible by ``num_heads``.
        num_heads: Heads ``H``.
        qkv_bias: Bias on the qkv projection.
        qk_norm: Normalise q and k per head with ``norm_layer`` (else ``nn.Identity``).
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
        norm_layer: The QK-norm, built as ``norm_layer(head_dim)``; ``None`` for :func:`rms_norm`.
        device: Device to build on.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: Callable[..., nn.Module] | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            dim, num_heads, qkv_bias, attn_drop, proj_drop, device, dtype, qk_norm=qk_norm, norm_layer=norm_layer
        )

    def _build_qkv(
        self,
        dim: int,
        qkv_bias: bool,
        qk_norm: bool = True,
        norm_layer: Callable[..., nn.Module] | None = None,
        **dd: Any,
    ) -> None:
        super()._build_qkv(dim, qkv_bias, **dd)
        norm_layer = norm_layer or rms_norm()
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``; rope: ``(sin, cos)``, each ``(N, head_dim)``. Returns: ``(B, N, C)``."""
        B, N, C = x.shape
        q, k, v = self._split_qkv(x).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        x = self._attend(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self._project(x)


class Vit5Block(PreNormBlock):
    """Pre-norm transformer block with LayerScale on both residual branches and rotary attention.

    The arguments are those of :class:`~timm_layerscale.layers.block.PreNormBlock`, with
    :func:`rms_norm` as the default norm and :class:`Vit5Attention` as the default
    attention, which also gets ``qk_norm`` and ``norm_layer``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qk_norm: bool = True,
        norm_layer: Callable[..., nn.Module] | None = None,
        attn_layer: Callable[..., nn.Module] = Vit5Attention,
        **kwargs: Any,
    ) -> None:
        norm_layer = norm_layer or rms_norm()
        attn = partial(attn_layer, qk_norm=qk_norm, norm_layer=norm_layer)
        super().__init__(dim, num_heads, attn, norm_layer=norm_layer, **kwargs)

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``; rope: tables for all ``N`` tokens. Returns: ``(B, N, C)``."""
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope=rope)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x
