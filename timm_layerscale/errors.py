"""Exceptions for user-facing failures.

Every error a user can cause (a bad file, a wrong model name, a failed upload)
is a :class:`LayerScaleError` whose message is one line saying what is wrong and
what to do. The command line prints that line and exits with the error's
:attr:`~LayerScaleError.exit_code`; ``--debug`` shows the traceback.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LayerScaleError",
    "CheckpointError",
    "RemapError",
    "ArchitectureError",
    "OutputExistsError",
    "HubError",
    "ParityError",
]


class LayerScaleError(Exception):
    """Base class of the errors a user can cause; the message is one line.

    Advice in the message is written for Python callers (``pass overwrite=True``);
    the command line says it as options (``pass --overwrite``).

    Attributes:
        exit_code: The command line's exit status for this error: 2, a user error
            (a failed verification is 1).
    """

    exit_code = 2


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


class ParityError(LayerScaleError):
    """The converted model's outputs (or weights) do not match the reference's (exit code 1).

    Attributes:
        report: The :class:`~timm_layerscale.parity.compare.ParityReport` that failed.
    """

    exit_code = 1

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report
