"""Exceptions for user-facing failures.

Every error a user can cause (a bad file, a wrong model name, a failed upload)
is a :class:`LayerScaleError` whose message is one line saying what is wrong and
what to do. The command line prints that line and exits non-zero; ``--debug``
shows the traceback.
"""
from __future__ import annotations

__all__ = [
    "LayerScaleError",
    "CheckpointError",
    "RemapError",
    "ArchitectureError",
    "OutputExistsError",
    "HubError",
]


class LayerScaleError(Exception):
    """Base class of the errors a user can cause; the message is one line."""


class CheckpointError(LayerScaleError):
    """A checkpoint file cannot be read, is malformed, or cannot be written."""


class RemapError(LayerScaleError):
    """A state dict does not fit the target layout (missing, unexpected or mis-shaped keys)."""


class ArchitectureError(LayerScaleError):
    """No registered model fits a checkpoint, or a named model does not exist."""


class OutputExistsError(LayerScaleError):
    """The output path exists and ``--overwrite`` was not given."""


class HubError(LayerScaleError):
    """A Hugging Face Hub request failed (authentication, repository, network)."""
