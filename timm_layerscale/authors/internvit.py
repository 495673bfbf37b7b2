"""InternViT in the authors' key layout (OpenGVLab/InternVL ``modeling_intern_vit.py``, ``InternVisionModel`` with
LayerNorm, q/k/v bias and no q/k norm, as the 300M is configured), written from their computation in plain PyTorch:
the parity reference of the ``internvit`` family's ``official`` layout, since no installed library reads it.

Keys: ``embeddings.{class_embedding, patch_embedding, position_embedding}`` and ``encoder.layers.N.{norm1, attn.qkv,
attn.proj, ls1, norm2, mlp.fc1, mlp.fc2, ls2}``. Forward: the patches plus the class token, plus the position
embedding, its grid resampled (bicubic, no antialias) to the input's; per block ``x + attn(norm1(x)) * ls1`` then
``x + mlp(norm2(x)) * ls2``, attention ``softmax((q * scale) @ k^T) @ v``; no final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .vit5 import Mlp  # fc1, exact GELU, fc2: the authors' InternMLP too

__all__ = ["InternVisionOfficial"]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Layer(nn.Module):
    def __init__(self, dim: int, num_heads: int, init_values: float) -> None:
        super().__init__()
        self.attn = Attention(dim, num_heads)
        self.mlp = Mlp(dim, 4 * dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ls1 = nn.Parameter(init_values * torch.ones(dim))
        self.ls2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x)) * self.ls1
        return x + self.mlp(self.norm2(x)) * self.ls2


class Embeddings(nn.Module):
    def __init__(self, img_size: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.grid = img_size // patch_size
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(1, self.grid**2 + 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(x)
        B, C, H, W = patches.shape
        tokens = torch.cat([self.class_embedding.expand(B, 1, -1), patches.flatten(2).transpose(1, 2)], dim=1)
        grid = self.position_embedding[:, 1:].reshape(1, self.grid, self.grid, C).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(H, W), mode="bicubic", align_corners=False)
        return tokens + torch.cat([self.position_embedding[:, :1], grid.reshape(1, C, H * W).transpose(1, 2)], dim=1)


class Encoder(nn.Module):
    def __init__(self, depth: int, dim: int, num_heads: int, init_values: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(dim, num_heads, init_values) for _ in range(depth)])


class InternVisionOfficial(nn.Module):
    """The authors' InternViT, fp32, any input size (a multiple of ``patch_size``); the arguments are those of timm's
    ``VisionTransformer`` of the same name."""

    def __init__(
        self,
        img_size: int = 448,
        patch_size: int = 14,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        init_values: float = 0.1,
    ) -> None:
        super().__init__()
        self.embeddings = Embeddings(img_size, patch_size, embed_dim)
        self.encoder = Encoder(depth, embed_dim, num_heads, init_values)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, H, W)`` to the last layer's tokens ``(B, 1 + H * W / patch_size**2, C)``, class first."""
        x = self.embeddings(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The class token of :meth:`forward_features` ``(B, C)``, the authors' ``pooler_output``."""
        return self.forward_features(x)[:, 0]
