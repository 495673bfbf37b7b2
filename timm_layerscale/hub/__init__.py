"""The Hugging Face Hub and URL boundary: downloads, uploads, export folders and model cards.

- :mod:`~timm_layerscale.hub.download`: ``https://`` and ``hf-hub:`` sources, cached; the offline checks;
- :mod:`~timm_layerscale.hub.upload`: :func:`~timm_layerscale.hub.upload.push_folder` and its plan;
- :mod:`~timm_layerscale.hub.errors`: Hub exceptions mapped to one-line messages;
- :mod:`~timm_layerscale.hub.config`: ``config.json`` and class-name files;
- :mod:`~timm_layerscale.hub.card`: the model card, rendered from a template;
- :mod:`~timm_layerscale.hub.export`: :func:`~timm_layerscale.hub.export.export_folder`, the folder
  ``timm.create_model("hf-hub:...")`` loads.

Importing this package imports none of them (nor torch or huggingface_hub); each
name below is imported from its module on first use.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

_LAZY = {
    "download_source": ".download",
    "cached_url_path": ".download",
    "check_online": ".download",
    "hub_endpoint": ".download",
    "push_folder": ".upload",
    "plan_push": ".upload",
    "PushResult": ".upload",
    "require_token": ".upload",
    "check_repo_id": ".upload",
    "hub_errors": ".errors",
    "export_folder": ".export",
    "ExportResult": ".export",
    "build_model_card": ".card",
    "write_config": ".config",
    "read_label_names": ".config",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
