"""ViT-5 in the official checkpoint layout, written from the published math (Wang et al., arXiv 2602.08071)
in plain PyTorch: the parity reference of the ``vit5`` family, since timm has none.

It loads an official state dict strictly (``blocks.N.gamma_1``, the ``rope.freqs`` / ``rope_reg.freqs``
buffers, ``reg_token``) and computes the official forward pass operation for operation: the patch
embedding plus ``pos_embed``; tokens ``[cls, patches..., registers...]``; per block
``x + gamma_1 * attn(RMSNorm(x))`` then ``x + gamma_2 * mlp(RMSNorm(x))``, where attention RMS-normalises q
and k per head, rotates the patches' (positions ``i / n * n_train``, theta 10000) and the registers' (a 2 x 2
grid, theta 100) and computes ``softmax(q k^T / sqrt(d)) v``; the final RMSNorm, the class token and the
head. It shares only the frequency table and the pair rotation with :mod:`timm_layerscale.models.vit5`;
:func:`timm_layerscale.families.vit5.official_model` builds it for a variant.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..layers.rope import rope_bands, rotate_pairs

__all__ = ["Vit5Official"]


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension, computed in fp32 and the weight
    multiplied after casting back, as the official code does."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class VisionRope(nn.Module):
    """2-D rotary embedding of the tokens of a square grid of side ``n`` (positions ``arange(n) / n *
    pt_seq_len``); ``dim`` is half the head width, the frequencies a persistent ``freqs`` buffer."""

    def __init__(self, dim: int, pt_seq_len: int, theta: float = 10000) -> None:
        super().__init__()
        freqs = rope_bands(2 * dim, theta)
        self.register_buffer("freqs", freqs)
        self.pt_seq_len = pt_seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, n * n, H, d)`` of the grid, in row-major order, rotated."""
        side = math.isqrt(x.shape[1])
        if side * side != x.shape[1]:
            raise ValueError(f"rotary embedding expects a square grid of tokens, got {x.shape[1]}")
        t = torch.arange(side, device=x.device) / side * self.pt_seq_len
        angles = torch.einsum("i,f->if", t, self.freqs.to(x.device, torch.float32))
        angles = angles.repeat_interleave(2, dim=-1)
        rows = angles[:, None, :].expand(side, side, -1)
        cols = angles[None, :, :].expand(side, side, -1)
        angles = torch.cat((rows, cols), dim=-1)
        cos = angles.cos().view(-1, 1, angles.shape[-1])
        sin = angles.sin().view(-1, 1, angles.shape[-1])
        return (x * cos + rotate_pairs(x) * sin).to(x.dtype)  # angles in fp32, result in the input's dtype


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, pt_seq_len: int, num_registers: int, reg_theta: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.num_registers = num_registers
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.rope = VisionRope(head_dim // 2, pt_seq_len)
        self.rope_reg = VisionRope(head_dim // 2, math.isqrt(num_registers), theta=reg_theta)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        reg = N - self.num_registers
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).unbind(dim=2)
        q = self.q_norm(q).to(v.dtype)
        k = self.k_norm(k).to(v.dtype)
        q = torch.cat((q[:, :1], self.rope(q[:, 1:reg]), self.rope_reg(q[:, reg:])), dim=1)
        k = torch.cat((k[:, :1], self.rope(k[:, 1:reg]), self.rope_reg(k[:, reg:])), dim=1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, pt_seq_len: int, num_registers: int, reg_theta: float, init_values: float
    ) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, num_heads, pt_seq_len, num_registers, reg_theta)
        self.norm2 = RMSNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        x = x + self.gamma_2 * self.mlp(self.norm2(x))
        return x


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int) -> None:
        super().__init__()
        self.img_size = img_size
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"input size {tuple(x.shape[-2:])} is not the model's ({self.img_size}, {self.img_size})")
        return self.proj(x).flatten(2).transpose(1, 2)


class Vit5Official(nn.Module):
    """ViT-5 with the official parameter names and forward pass; the arguments are those of
    :class:`~timm_layerscale.models.vit5.Vit5` (``num_registers`` register tokens, a square number)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        num_registers: int = 4,
        reg_theta: float = 100,
        init_values: float = 1e-4,
    ) -> None:
        super().__init__()
        grid = img_size // patch_size
        self.num_classes = num_classes
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.reg_token = nn.Parameter(torch.zeros(1, num_registers, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid, embed_dim))
        self.blocks = nn.ModuleList(
            [Block(embed_dim, num_heads, grid, num_registers, reg_theta, init_values) for _ in range(depth)]
        )
        self.norm = RMSNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to the normalised class token ``(B, C)``."""
        B = x.shape[0]
        x = self.patch_embed(x) + self.pos_embed
        x = torch.cat((self.cls_token.expand(B, -1, -1), x, self.reg_token.expand(B, -1, -1)), dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))
