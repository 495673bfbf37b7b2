"""Publishing: export folders (:mod:`.export`), their ``config.json`` (:mod:`.config`) and model card
(:mod:`.card`), and uploads to the Hugging Face Hub (:mod:`.upload`)."""

from __future__ import annotations

from .config import write_config
from .export import ExportResult, export_folder
from .upload import PushResult, push_folder

__all__ = ["ExportResult", "PushResult", "export_folder", "push_folder", "write_config"]
