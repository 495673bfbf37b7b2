"""The Hugging Face Hub and URL boundary: downloads, uploads, export folders and model cards.

- :mod:`.download`: ``https://`` and ``hf-hub:`` sources, cached;
- :mod:`.upload`: :func:`push_folder` and its plan;
- :mod:`.errors`: Hub exceptions mapped to one-line messages;
- :mod:`.card`: the model card, rendered from a template;
- :mod:`.export`: :func:`export_folder`, the folder ``timm.create_model("hf-hub:...")`` loads.
"""
from __future__ import annotations

from .._lazy import lazy_attributes

_LAZY = {
    "download_source": ".download",
    "push_folder": ".download",
    "plan_push": ".download",
    "PushResult": ".download",
    "export_folder": ".export",
    "ExportResult": ".export",
    "build_model_card": ".card",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
