"""Publishing: export folders, model cards and their config, uploads to the Hugging Face Hub.

- :mod:`~timm_layerscale.hub.upload`: :func:`~timm_layerscale.hub.upload.push_folder` and its plan;
- :mod:`~timm_layerscale.hub.config`: ``config.json`` and class-name files;
- :mod:`~timm_layerscale.hub.card`: the model card, rendered from a template;
- :mod:`~timm_layerscale.hub.export`: :func:`~timm_layerscale.hub.export.export_folder`, the folder
  ``timm.create_model("hf-hub:...")`` loads.

Downloads and Hub errors are in :mod:`timm_layerscale.files.sources` and
:mod:`timm_layerscale.files.hub_errors`.
"""

from __future__ import annotations

from .card import build_model_card
from .config import read_label_names, write_config
from .export import ExportResult, export_folder
from .upload import PushResult, check_repo_id, plan_push, push_folder, require_token

__all__ = [
    "ExportResult",
    "PushResult",
    "build_model_card",
    "check_repo_id",
    "export_folder",
    "plan_push",
    "push_folder",
    "read_label_names",
    "require_token",
    "write_config",
]
