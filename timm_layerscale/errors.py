"""Errors a user can cause: each is one line saying what is wrong and what to do.

The command line prints that line and exits with the error's ``exit_code``; ``--debug`` shows the
traceback. Advice names an option as the caller passes it (:func:`option`).
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["ArchitectureError", "CheckpointError", "FoldError", "HubError", "LayerScaleError", "OutputExistsError"]
__all__ += ["ParityError", "RemapError", "one_line", "option"]

#: Set by the command line while it runs a command.
COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("timm_layerscale_command_line", default=False)


def option(name: str, value: Any = True) -> str:
    """An option as the caller writes it: ``--name value`` on the command line, ``name=value`` in Python."""
    if not COMMAND_LINE.get():
        return f"{name}={value!r}"
    flag = "--" + {"fmt": "format"}.get(name, name).replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def one_line(x: Any, limit: int = 160) -> str:
    """``str(x)`` on one line, cut to ``limit`` characters."""
    text = " ".join(str(x).split())
    return text[: limit - 3] + "..." if len(text) > limit else text


class LayerScaleError(Exception):
    """Base class of the errors a user can cause (exit status 2 on the command line)."""

    exit_code = 2


class CheckpointError(LayerScaleError):
    """A checkpoint file cannot be read, is malformed, or cannot be written."""


class RemapError(LayerScaleError):
    """A state dict does not fit the target layout (missing, unexpected or mis-shaped keys)."""


class FoldError(RemapError, ValueError):
    """A LayerScale gate cannot fold into the layer before it (its family says why, or the layer is missing)."""


class ArchitectureError(LayerScaleError):
    """No registered model fits a checkpoint, or a named model does not exist."""


class OutputExistsError(LayerScaleError):
    """The output exists and overwriting was not asked for."""


class HubError(LayerScaleError):
    """A Hugging Face Hub request failed (authentication, repository, network)."""


class ParityError(LayerScaleError):
    """The converted model's outputs or weights do not match the reference's (exit status 1).

    Attributes:
        report: The :class:`~timm_layerscale.parity.compare.ParityReport` that failed.
    """

    exit_code = 1

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report
