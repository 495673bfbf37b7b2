"""LayerScale models for timm, checkpoint conversion between layouts, and parity checks.

Importing the package registers its models with timm (the moment timm is imported, if it is not yet),
so ``timm.create_model("cait_s24_224_ls")`` works; ``import timm_layerscale`` alone loads neither torch
nor timm. The public names are imported on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ._version import __version__
from .conversion.rules import to_gamma, to_layerscale
from .errors import LayerScaleError

__all__ = ["__version__", "ConversionResult", "convert_checkpoint", "verify_checkpoint", "read_source"]
__all__ += ["LayerScale", "LayerScaleError", "cait_init_value", "fold_state_dict", "fold_layerscale"]
__all__ += ["param_groups", "VerifyOptions", "to_layerscale", "to_gamma", "models"]

_LAZY = {
    "LayerScale": ".layer_scale",
    "cait_init_value": ".layer_scale",
    "param_groups": ".layer_scale",
    "fold_layerscale": ".conversion.fold",
    "fold_state_dict": ".conversion.fold",
    "VerifyOptions": ".parity.tolerance",
    "models": ".models",
    "ConversionResult": ".converter",
    "convert_checkpoint": ".converter",
    "verify_checkpoint": ".converter",
    "read_source": ".converter",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = module if _LAZY[name] == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _register_when_timm_is_imported() -> None:
    try:
        from _timm_layerscale_autoload import install
    except ImportError:  # it ships with the package; a partial copy registers now
        install = None  # type: ignore[assignment]
    if "timm" in sys.modules or install is None:
        importlib.import_module(".models", __name__)
    else:
        install(force=True)  # an explicit import registers even where the start-up hook is off


_register_when_timm_is_imported()
