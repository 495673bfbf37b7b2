"""What the commands show: progress bars for long work (writing a checkpoint, verification's
forward passes), tqdm's on stderr, and output lines on stdout (:func:`write_out`).

A bar is drawn only when stderr is a terminal and the work lasts longer than
half a second (``DELAY``), so short runs, pipes, logs and CI stay clean.
:func:`disable_progress_bars` (the command line's ``--quiet``) turns them off, together with
huggingface_hub's download bars and torch.hub's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .errors import LayerScaleError

__all__ = ["bar", "disable_progress_bars", "enabled", "write_out"]

#: Seconds of work before a bar appears.
DELAY = 0.5

_disabled = False


def disable_progress_bars(disable: bool = True) -> None:
    """Turn every progress bar off (this package's, huggingface_hub's and torch.hub's), or on again."""
    global _disabled
    _disabled = disable
    from huggingface_hub.utils import disable_progress_bars as off
    from huggingface_hub.utils import enable_progress_bars as on

    (off if disable else on)()


def enabled() -> bool:
    """Whether bars are drawn now: not disabled, and stderr is a terminal."""
    try:
        return not _disabled and sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def bar(iterable: Any = None, **options: Any) -> Any:
    """A ``tqdm`` bar on stderr, silent unless :func:`enabled`; ``options`` are tqdm's (``total``, ``desc``, ``unit``)."""
    from tqdm import tqdm

    settings: dict[str, Any] = {"leave": False, "delay": DELAY, "disable": not enabled(), "file": sys.stderr}
    if options.get("unit") == "B":
        settings.update(unit_scale=True, unit_divisor=1024)
    return tqdm(iterable, dynamic_ncols=True, **settings, **options)


def write_out(text: str, end: str = "\n") -> None:
    """Print ``text`` (and ``end``) on standard output at once, with what waits in its buffer.

    If the output refuses it (its reader has left, as ``| head`` may, or its device is
    full), standard output is pointed at the null device, so that Python's exit does not
    fail on it again, and :class:`BrokenPipeError` or a one-line
    :class:`~timm_layerscale.errors.LayerScaleError` is raised.
    """
    try:
        print(text, end=end, flush=True)
    except OSError as e:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
        except (OSError, ValueError):  # standard output is no file (a test's capture)
            pass
        if isinstance(e, BrokenPipeError):
            raise
        raise LayerScaleError(
            f"writing the output failed ({e.strerror}); free space on its device or send it elsewhere"
        ) from e
