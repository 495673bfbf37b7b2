"""LayerScale models for timm, checkpoint conversion between layouts, and parity checks.

Importing this package registers its models with timm, so that
``timm.create_model("cait_s24_224_ls")`` works. If timm is not imported yet, the
models are registered the moment it is (right after timm's own import finishes),
so ``import timm_layerscale`` alone loads neither torch nor timm and the command
line starts instantly. The public names below are imported on first use.
"""

from __future__ import annotations

import importlib
import sys

from ._lazy import lazy_attributes
from ._version import __version__
from .conversion.keys import to_gamma, to_layerscale
from .errors import LayerScaleError

__all__ = [
    "__version__",
    "LayerScale",
    "LayerScaleError",
    "cait_init_value",
    "fold_state_dict",
    "fuse_layerscale",
    "param_groups",
    "VerifyOptions",
    "to_layerscale",
    "to_gamma",
    "models",
]

_LAZY = {
    "LayerScale": ".layer_scale",
    "cait_init_value": ".layer_scale",
    "param_groups": ".layer_scale",
    "fuse_layerscale": ".conversion.fold",
    "fold_state_dict": ".conversion.fold",
    "VerifyOptions": ".parity.tolerance",
    "models": ".models",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


def _register_when_timm_is_imported() -> None:
    if "timm" in sys.modules:
        importlib.import_module(".models", __name__)
        return
    try:
        import _timm_layerscale_autoload as hook
    except ImportError:  # the hook module ships with the package; a partial copy registers now
        importlib.import_module(".models", __name__)
        return
    # An explicit import registers even where the start-up hook is switched off.
    hook.install(force=True)


_register_when_timm_is_imported()
