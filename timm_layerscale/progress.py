"""Progress bars for long work: writing a converted checkpoint, verification's forward passes.

Bars are drawn with tqdm on stderr, only when stderr is a terminal, and only for
work that lasts longer than :data:`DELAY` seconds, so short runs, pipes, logs and CI
stay clean. :func:`disable_progress_bars` (the command line's ``--quiet``) turns them
off, together with huggingface_hub's download bars and torch.hub's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["bar", "enabled", "disable_progress_bars", "enable_progress_bars", "verification_passes", "ByteCounter"]

T = TypeVar("T")

#: Seconds of work before a bar appears.
DELAY = 0.5

_disabled = False


def disable_progress_bars() -> None:
    """Turn every progress bar off (this package's, huggingface_hub's and torch.hub's)."""
    global _disabled
    _disabled = True
    try:
        from huggingface_hub.utils import disable_progress_bars as hf_disable
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return
    hf_disable()


def enable_progress_bars() -> None:
    """Undo :func:`disable_progress_bars` (bars still need a terminal on stderr)."""
    global _disabled
    _disabled = False
    try:
        from huggingface_hub.utils import enable_progress_bars as hf_enable
    except ImportError:  # pragma: no cover
        return
    hf_enable()


def enabled() -> bool:
    """Whether bars are drawn now: not disabled, and stderr is a terminal."""
    if _disabled:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def bar(
    iterable: Iterable[T] | None = None,
    *,
    total: float | None = None,
    desc: str | None = None,
    unit: str = "it",
    unit_scale: bool = False,
) -> Any:
    """A tqdm bar on stderr that is silent unless :func:`enabled`.

    Args:
        iterable: Items to iterate over, or ``None`` for a bar updated by hand
            (``bar.update(n)``).
        total: Expected number of items (or bytes with ``unit="B"``).
        desc: Label in front of the bar.
        unit: Unit of one step.
        unit_scale: Print large counts with SI/binary prefixes (bytes as MiB, GiB).

    Returns:
        A ``tqdm`` object: iterate it, or call ``update`` and ``close`` (it is a
        context manager).
    """
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        unit_divisor=1024 if unit == "B" else 1000,
        leave=False,
        delay=DELAY,
        disable=not enabled(),
        file=sys.stderr,
        dynamic_ncols=True,
    )


def verification_passes(batches: Iterable[T]) -> Iterator[T]:
    """Wrap verification's batches so that each pair of forward passes advances a bar."""
    items = list(batches)
    yield from bar(items, total=len(items), desc="verifying", unit="batch")


class ByteCounter:
    """A binary file wrapper that advances a bar by the bytes written through it.

    ``torch.save`` writes to any object with ``write`` and ``flush``; wrapping the
    open file in this shows the progress of a ``.pth`` write.
    """

    def __init__(self, file: Any, progress: Any) -> None:
        self._file = file
        self._progress = progress

    def write(self, data: Any) -> int:
        n = self._file.write(data)
        self._progress.update(len(memoryview(data).cast("B")) if n is None else n)
        return n

    def flush(self) -> None:
        self._file.flush()
