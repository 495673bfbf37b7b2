"""Inputs of a parity check: seeded weights, seeded images, image files."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..families import FAMILIES

__all__ = ["seed_parameters_", "seeded_inputs", "image_inputs"]


@torch.no_grad()
def seed_parameters_(model: nn.Module, seed: int = 0, gamma_std: float = 0.1) -> nn.Module:
    """Fill every parameter of ``model`` with seeded random values in place, buffers kept, so that every
    branch matters: gates (any family's) ~ N(0, ``gamma_std``) (the 1e-5 init hides differences), matrices
    ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1), biases and the model's own embeddings and tokens (parameters
    of no layer) ~ N(0, 0.1). The values depend
    on the seed and the parameters' names, shapes and order; to fill two layouts alike, seed one and
    load its weights into the other. Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if any(family.gate_of(name) for family in FAMILIES.values()):
            v = torch.randn(shape, generator=gen) * gamma_std
        elif p.ndim >= 2 and "." in name:
            fan_in = math.prod(shape[1:])
            v = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        elif name.endswith("weight") and p.ndim == 1:
            v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            v = 0.1 * torch.randn(shape, generator=gen)
        p.copy_(v.to(p.dtype))
    return model


def seeded_inputs(num_inputs: int, img_size: int | Sequence[int], seed: int = 0, in_chans: int = 3) -> torch.Tensor:
    """Seeded N(0, 1) images ``(num_inputs, in_chans, H, W)`` in fp32, the scale of normalised photographs."""
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_inputs, in_chans, h, w, generator=gen)


def image_inputs(paths: Iterable[str], model: nn.Module) -> torch.Tensor:
    """Image files ``(len(paths), 3, H, W)`` through timm's data config and eval transforms for ``model``."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from ..errors import CheckpointError

    cfg = resolve_data_config({}, model=model)
    transform = create_transform(**cfg, is_training=False)
    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                out.append(transform(im.convert("RGB")))
        except (OSError, ValueError) as e:
            reason = getattr(e, "strerror", None) or e
            raise CheckpointError(
                f"cannot read image {p} ({reason}); pass image files Pillow opens (JPEG, PNG, ...)"
            ) from None
    return torch.stack(out)
