"""Model files; importing this package registers every model with timm."""
from . import cait_ls
from .cait_ls import CaitLS
from . import vit5

__all__ = ["CaitLS", "cait_ls", "vit5"]
