"""2-D rotary position embedding on a grid of tokens (ViT-5): a head's channels split in two halves, one
per grid axis, and within a half the pairs ``(2i, 2i+1)`` rotated by ``position * theta ** (-2i / (d / 2))``."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RopeTables", "Vit5RotaryEmbedding", "apply_rope", "rope_bands", "rotate_pairs"]


def rope_bands(head_dim: int, theta: float) -> torch.Tensor:
    """The frequencies of one grid axis for heads ``head_dim`` wide (a multiple of 4): fp32 ``(head_dim // 4,)``,
    ``1 / theta ** (2i / (head_dim // 2))`` (ViT-5's theta: 10000 for the patches, 100 for the registers)."""
    if head_dim % 4:
        raise ValueError(f"2-D rotary embedding needs a head width divisible by 4, got {head_dim}")
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs by 90 degrees over the last dimension: ``(a, b) -> (-b, a)``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


#: ``(sin, cos)`` tables, each ``(N, head_dim)``, one row per token.
RopeTables = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x (..., N, head_dim)`` by the ``(sin, cos)`` tables ``(N, head_dim)``."""
    sin, cos = rope
    return (x * cos + rotate_pairs(x) * sin).to(x.dtype)


@torch.fx.wrap  # one node of an FX trace, so that a traced grid size (dynamic_img_size) reaches it as a number
def _grid_angles(h: int, w: int, ref_grid: tuple[int, int], bands: torch.Tensor) -> torch.Tensor:
    """Angles ``(h * w, 4 * len(bands))`` of a row-major ``h x w`` grid, on ``bands``' device."""
    ang_h = (torch.arange(h, device=bands.device) / h * ref_grid[0])[:, None] * bands
    ang_w = (torch.arange(w, device=bands.device) / w * ref_grid[1])[:, None] * bands
    ang_h = ang_h.repeat_interleave(2, dim=-1)[:, None, :].expand(h, w, -1)
    ang_w = ang_w.repeat_interleave(2, dim=-1)[None, :, :].expand(h, w, -1)
    return torch.cat((ang_h, ang_w), dim=-1).reshape(h * w, -1)


class Vit5RotaryEmbedding(nn.Module):
    """2-D axial rotary embedding of heads ``head_dim`` wide, with interleaved pairs and positions scaled to
    ``ref_grid`` (a grid ``H x W`` gets positions ``r / H * H_ref``). It holds no parameters or buffers: the
    tables are computed on demand (frequencies on the CPU, positions and angles on the target device, as the
    official code does), so it works unchanged after a meta-device build."""

    def __init__(self, head_dim: int, ref_grid: tuple[int, int], theta: float = 10000.0) -> None:
        super().__init__()
        rope_bands(head_dim, theta)  # validates head_dim
        self.head_dim = head_dim
        self.ref_grid = (int(ref_grid[0]), int(ref_grid[1]))
        self.theta = theta

    def get_embed(self, grid: tuple[int, int], device: torch.device | None = None) -> RopeTables:
        """``(sin, cos)`` tables of a row-major ``(H, W)`` grid on ``device``, each fp32 ``(H * W, head_dim)``."""
        ang = _grid_angles(grid[0], grid[1], self.ref_grid, rope_bands(self.head_dim, self.theta).to(device))
        return ang.sin(), ang.cos()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, ref_grid={self.ref_grid}, theta={self.theta:g}"
