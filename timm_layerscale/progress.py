"""Progress bars for long work (writing a checkpoint, verification's forward passes): tqdm's on stderr.

A bar is drawn only when stderr is a terminal and the work lasts longer than
half a second (``DELAY``), so short runs, pipes, logs and CI stay clean.
:func:`disable_progress_bars` (the command line's ``--quiet``) turns them off, together with
huggingface_hub's download bars and torch.hub's.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["bar", "disable_progress_bars", "enabled"]

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
