"""Model files; importing this package registers every model with timm."""

from . import cait_ls, vit5
from .cait_ls import CaitLS

__all__ = ["CaitLS", "cait_ls", "vit5"]
