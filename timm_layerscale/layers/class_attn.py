"""Class attention (CaiT): the class token queries itself and all patch tokens, and its block.

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021,
https://arxiv.org/abs/2103.17239, section 3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .attention import SdpaAttention
from .block import PreNormBlock

__all__ = ["ClassAttn", "LayerScaleBlockClassAttn"]


class ClassAttn(SdpaAttention):
    """Class attention: the class token queries the class token and all patch tokens.

    Separate ``q`` / ``k`` / ``v`` linears (the query is computed for the class token
    only); the other arguments are those of :class:`~timm_layerscale.layers.attention.MultiHeadAttention`.
    """

    def _build_qkv(self, dim: int, qkv_bias: bool, **dd: Any) -> None:
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.k = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.v = nn.Linear(dim, dim, bias=qkv_bias, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: ``(B, 1 + N, C)``, class token first. Returns: ``(B, 1, C)``."""
        B, N, C = x.shape
        q = self.q(x[:, 0]).unsqueeze(1).reshape(B, 1, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        v = self.v(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        x_cls = self._attend(q, k, v)
        x_cls = x_cls.transpose(1, 2).reshape(B, 1, C)
        return self._project(x_cls)


class LayerScaleBlockClassAttn(PreNormBlock):
    """Class-attention block: updates the class token only, with LayerScale on both branches.

    The arguments are those of :class:`~timm_layerscale.layers.block.PreNormBlock`, with
    :class:`ClassAttn` as the default attention.
    """

    def __init__(
        self, dim: int, num_heads: int, attn_layer: Callable[..., nn.Module] = ClassAttn, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, attn_layer, **kwargs)

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Args: x: patch tokens ``(B, N, C)``; x_cls: class token ``(B, 1, C)``. Returns: ``(B, 1, C)``."""
        u = torch.cat((x_cls, x), dim=1)
        x_cls = x_cls + self.drop_path1(self.ls1(self.attn(self.norm1(u))))
        x_cls = x_cls + self.drop_path2(self.ls2(self.mlp(self.norm2(x_cls))))
        return x_cls
