"""LayerScale models for timm, checkpoint conversion between layouts, and parity checks.

Importing this package registers its models with timm, so that
``timm.create_model("cait_s24_224_ls")`` works.
"""
from ._version import __version__
from .errors import LayerScaleError
from .layer_scale import LayerScale, cait_init_value, param_groups
from .remap import to_gamma, to_layerscale
from . import models

__all__ = [
    "__version__",
    "LayerScale",
    "LayerScaleError",
    "cait_init_value",
    "param_groups",
    "to_layerscale",
    "to_gamma",
    "models",
]
