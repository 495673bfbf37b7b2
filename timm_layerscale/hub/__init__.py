"""Publishing: export folders (:mod:`.export`), their ``config.json`` (:mod:`.config`) and model card
(:mod:`.card`), and uploads to the Hugging Face Hub (:mod:`.upload`)."""

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
