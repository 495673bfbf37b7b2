"""2-D rotary position embedding on a square grid of tokens (ViT-5).

Each attention head's channels are split in two halves, one per grid axis; within a
half, channel pairs ``(2i, 2i+1)`` are rotated by the angle ``position * freq_i`` with
``freq_i = theta ** (-2i / (head_dim / 2))``.
"""
from __future__ import annotations

import torch

__all__ = ["rope_bands", "rotate_pairs"]


def rope_bands(head_dim: int, theta: float) -> torch.Tensor:
    """Rotary frequencies of one grid axis.

    Args:
        head_dim: Width of one attention head, a multiple of 4.
        theta: Base of the frequency progression (ViT-5: 10000 for patches, 100 for registers).

    Returns:
        fp32 CPU tensor ``(head_dim // 4,)``: ``1 / theta ** (2i / (head_dim // 2))``.
    """
    if head_dim % 4:
        raise ValueError(f"2-D rotary embedding needs a head width divisible by 4, got {head_dim}")
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs by 90 degrees over the last dimension: ``(a, b) -> (-b, a)``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
