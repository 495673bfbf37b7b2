"""Pre-norm transformer block with LayerScale on both residual branches.

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021,
https://arxiv.org/abs/2103.17239, section 2::

    x = x + drop_path(ls1(attn(norm1(x))))
    x = x + drop_path(ls2(mlp(norm2(x))))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..layer_scale import layer_scale_or_identity

__all__ = ["PreNormBlock"]


class PreNormBlock(nn.Module):
    """Pre-norm transformer block with LayerScale on both residual branches.

    Args:
        dim: Token width ``C``.
        num_heads: Attention heads.
        attn_layer: Attention type, built as ``attn_layer(dim, num_heads=..., qkv_bias=...,
            attn_drop=..., proj_drop=...)``.
        mlp_ratio: MLP hidden width as a multiple of ``C``.
        qkv_bias: Bias on the attention's input projections.
        proj_drop: Dropout after the attention projection and in the MLP.
        attn_drop: Dropout on attention weights.
        drop_path: Stochastic depth rate of both branches.
        init_values: LayerScale initial value; ``None`` for no LayerScale (``nn.Identity``).
            The gates multiply with type promotion (``LayerScale(promote=True)``), as
            ``gamma_1 * x`` does in the official blocks, so autocast runs their arithmetic.
        act_layer: MLP activation.
        norm_layer: Norm before each branch.
        mlp_layer: MLP type; ``None`` for timm's ``Mlp``.
        device: Device to build on.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_layer: Callable[..., nn.Module],
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = 1e-4,
        act_layer: type[nn.Module] = nn.GELU,
        norm_layer: Callable[..., nn.Module] = nn.LayerNorm,
        mlp_layer: type[nn.Module] | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        from timm.layers import DropPath, Mlp  # at build, not at import: timm's import registers the models

        super().__init__()
        dd = {"device": device, "dtype": dtype}
        mlp_layer = mlp_layer or Mlp
        self.norm1 = norm_layer(dim, **dd)
        self.attn = attn_layer(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **dd
        )
        self.ls1 = layer_scale_or_identity(dim, init_values, promote=True, **dd)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim, **dd)
        self.mlp = mlp_layer(
            in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd
        )
        self.ls2 = layer_scale_or_identity(dim, init_values, promote=True, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``. Returns: ``(B, N, C)``."""
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x
