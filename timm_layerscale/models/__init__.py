"""The model files; importing this package registers every model with timm."""

from . import cait_ls, dinov3_ls, vit5, vit5_official
from .cait_ls import CaitLS
from .dinov3_ls import DinoV3LS
from .vit5 import Vit5

__all__ = ["CaitLS", "DinoV3LS", "Vit5", "cait_ls", "dinov3_ls", "vit5", "vit5_official"]
