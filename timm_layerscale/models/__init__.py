"""The model files; importing this package registers every model with timm."""

from . import cait_ls, vit5
from .cait_ls import CaitLS
from .vit5 import Vit5

__all__ = ["CaitLS", "Vit5", "cait_ls", "vit5"]
