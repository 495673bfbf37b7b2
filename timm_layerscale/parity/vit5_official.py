"""ViT-5 in the official checkpoint layout, written from the published math in plain PyTorch.

Paper: Wang et al., "ViT-5: Vision Transformers for the Mid-2020s", arXiv 2602.08071.

timm has no ViT-5, so this module is the parity reference of the ``vit5`` family: it
loads an official state dict with ``load_state_dict(..., strict=True)`` (the keys are
the official ones: ``blocks.N.gamma_1`` / ``gamma_2``, ``blocks.N.attn.rope.freqs`` /
``rope_reg.freqs`` buffers, ``reg_token``, ...) and computes the official forward pass
operation for operation:

1. patch embedding (16 x 16 conv), plus the learned ``pos_embed`` on patch tokens only;
2. tokens ``[cls, patches..., registers...]``;
3. each block: ``x + gamma_1 * attn(RMSNorm(x))``, then ``x + gamma_2 * mlp(RMSNorm(x))``;
4. attention: ``qkv`` (no bias) split into heads ``(B, N, H, d)``; RMSNorm of q and k per
   head; 2-D rotary embedding of the patch tokens (positions ``i / n * n_train`` on the
   ``n x n`` patch grid, ``theta = 10000``) and of the registers (2 x 2 grid,
   ``theta = 100``), class token untouched; ``softmax(q k^T / sqrt(d)) v``; ``proj``;
5. final RMSNorm, class token, linear head.

RMSNorm computes in fp32 and multiplies the weight after casting back, as the official
code does. It shares only the rotary frequency table and pair rotation (:mod:`timm_layerscale.layers.rope`)
with :mod:`timm_layerscale.models.vit5`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from ..families import Variant
from ..layers.rope import rope_bands, rotate_pairs

__all__ = ["Vit5Official", "build_official_vit5"]


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, the mean over the last dimension, in fp32."""

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
    """2-D rotary embedding of tokens on a square grid, frequencies in a persistent ``freqs`` buffer.

    Args:
        dim: Half the head width: each axis gets ``dim / 2`` frequencies
            ``theta ** (-2i / dim)``, each used for one pair of channels.
        pt_seq_len: Side of the training grid; a grid of side ``n`` gets positions
            ``arange(n) / n * pt_seq_len``.
        theta: Base of the frequency progression.
    """

    def __init__(self, dim: int, pt_seq_len: int, theta: float = 10000) -> None:
        super().__init__()
        freqs = rope_bands(2 * dim, theta)
        self.register_buffer("freqs", freqs)
        self.pt_seq_len = pt_seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: ``(B, n * n, H, d)``, tokens of an ``n x n`` grid in row-major order."""
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
    """ViT-5 with the official parameter names and forward pass.

    Args:
        img_size: Input resolution; fixes the patch grid and the rotary training grid.
        patch_size: Patch size.
        in_chans: Input channels.
        num_classes: Classifier outputs (0: no classifier, the class token is returned).
        embed_dim: Token width.
        depth: Number of blocks.
        num_heads: Attention heads.
        num_registers: Register tokens (a square number), appended after the patches.
        reg_theta: Rotary base of the registers.
        init_values: Initial LayerScale value.
    """

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


def build_official_vit5(variant: Variant, **kwargs: Any) -> Vit5Official:
    """The official-layout model of a ViT-5 variant, random weights.

    Args:
        variant: A ``vit5`` row of :data:`~timm_layerscale.families.VARIANTS`.
        **kwargs: Overrides of :class:`Vit5Official` arguments (``num_classes``, ...).
    """
    args: dict[str, Any] = dict(
        img_size=variant.img_size,
        patch_size=variant.patch_size,
        embed_dim=variant.embed_dim,
        depth=variant.depth,
        num_heads=variant.num_heads,
    )
    args.update(kwargs)
    return Vit5Official(**args)
