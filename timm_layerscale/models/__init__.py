"""The model files; importing this package registers every model with timm."""

from . import beit_ls, cait_ls, convnext_ls, dinov3_ls, pe_ls, resmlp_ls, vit5, xcit_ls
from .beit_ls import BeitLS
from .cait_ls import CaitLS
from .convnext_ls import ConvNeXtLS
from .dinov3_ls import DinoV3LS
from .resmlp_ls import ResMlpLS
from .vit5 import Vit5
from .xcit_ls import XcitLS

__all__ = ["BeitLS", "CaitLS", "ConvNeXtLS", "DinoV3LS", "ResMlpLS", "Vit5", "XcitLS", "beit_ls", "cait_ls"]
__all__ += ["convnext_ls", "dinov3_ls", "pe_ls", "resmlp_ls", "vit5", "xcit_ls"]
