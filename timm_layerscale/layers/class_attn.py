"""Class attention (CaiT): the class token queries itself and all patch tokens.

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021,
https://arxiv.org/abs/2103.17239, section 3.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .attention import SdpaAttention

__all__ = ["ClassAttn"]


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

