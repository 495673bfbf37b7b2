"""What the commands show: tqdm progress bars on stderr, drawn only on a terminal and for work of more
than half a second, and output lines on stdout (:func:`write_out`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from .errors import LayerScaleError

__all__ = ["bar", "disable_progress_bars", "enabled", "write_out"]

#: Seconds of work before a bar is drawn.
DELAY = 0.5
_disabled = False


def disable_progress_bars() -> None:
    """Turn every progress bar off: this package's, huggingface_hub's and torch.hub's."""
    global _disabled
    _disabled = True
    from huggingface_hub.utils import disable_progress_bars as hub_off

    hub_off()


def enabled() -> bool:
    """Whether bars are drawn now: not disabled, and stderr is a terminal."""
    try:
        return not _disabled and sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def bar(iterable: Any = None, **options: Any) -> Any:
    """A ``tqdm`` bar on stderr, silent unless :func:`enabled`; ``options`` are tqdm's."""
    from tqdm import tqdm

    if options.get("unit") == "B":
        options.update(unit_scale=True, unit_divisor=1024)
    return tqdm(
        iterable, leave=False, delay=DELAY, disable=not enabled(), file=sys.stderr, dynamic_ncols=True, **options
    )


def write_out(text: str, end: str = "\n") -> None:
    """Print ``text`` on standard output at once. If the output refuses it (its reader left, as ``| head``
    does, or its device is full), standard output is pointed at the null device, so that Python's exit
    does not fail on it again, and :class:`BrokenPipeError` or a one-line error is raised."""
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
