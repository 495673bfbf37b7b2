"""Atomic writes: a hidden temporary ``.{name}.tmp-{pid}-{hex}`` beside the output, moved onto it with
``os.replace`` when complete. The next write of the same output removes the temporaries of processes that
are gone, and those carrying this process's id that it did not open (in a container every run is pid 1)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointError, OutputExistsError, option

__all__ = ["atomic_output", "check_name", "folder_output", "output_path", "remove_stale"]

_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)-[0-9a-f]+")
_OPEN: set[str] = set()  # the temporaries this process is writing


def _temporary(folder: Path, name: str) -> Path:
    tmp = folder / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _OPEN.add(str(tmp))
    return tmp


def _dead(pid: int) -> bool:
    """Whether process ``pid`` is gone; a temporary of this process's own that it did not open is a dead run's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process
        pass
    return pid == os.getpid()


def remove_stale(folder: Path, name: str) -> None:
    """Remove the temporaries of ``folder / name`` that killed writers left behind."""
    with contextlib.suppress(OSError):
        for p in list(folder.iterdir()):
            m = _TEMPORARY.fullmatch(p.name)
            if m and m["name"] == name and str(p) not in _OPEN and _dead(int(m["pid"])):
                _remove(p)


def _remove(p: Path) -> None:
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def check_name(path: Path) -> None:
    """Refuse a name that is not UTF-8 (Python holds its bytes as surrogates), which torch cannot open."""
    if any("\ud800" <= c <= "\udfff" for c in str(path)):
        raise CheckpointError(
            f"{str(path)!r} is not a UTF-8 name, which PyTorch and safetensors cannot open; use a name in UTF-8"
        )


def output_path(path: str | os.PathLike[str], overwrite: bool) -> Path:
    """The file a write to ``path`` replaces (the one a symbolic link leads to), checked before any work:
    ``OutputExistsError`` if it exists and not ``overwrite``; ``CheckpointError`` if ``path`` ends in a slash, is
    not UTF-8, is a folder or not a regular file (``os.replace`` onto a device replaces the device), or its
    folder is missing or not writable."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):  # Path would drop the slash, which names a folder
        raise CheckpointError(
            f"output {text} ends in a slash, which names a folder; pass a file path such as {Path(text)}"
        )
    check_name(Path(text))
    shown, target = Path(text), Path(os.path.realpath(text)) if os.path.islink(text) else Path(text)
    if target.is_dir():
        raise CheckpointError(f"output {shown} is a directory; pass a file path such as {shown / 'model.safetensors'}")
    if target.exists() and not target.is_file():
        raise CheckpointError(f"output {shown} is not a regular file (a device or a pipe); pass a file path")
    if target.exists() and not overwrite:
        raise OutputExistsError(f"output {shown} exists; pass {option('overwrite')} to replace it")
    if not target.parent.is_dir():
        raise CheckpointError(f"output folder {target.parent} does not exist; create it or choose another output path")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"output folder {target.parent} is not writable; choose another output path")
    return target


def _write_error(where: Path, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"writing {where} failed ({e.strerror or e}); nothing was written, free space or choose another path"
    )


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (not yet created) and ``os.replace`` it onto ``path`` on success;
    on any exception, ``KeyboardInterrupt`` included, delete it and leave ``path`` as it was. A symbolic link
    is written through; a replaced file keeps its permission bits. Raises as :func:`output_path`, or
    :class:`~timm_layerscale.errors.CheckpointError` if the write failed (disk full)."""
    target = output_path(path, overwrite)
    remove_stale(target.parent, target.name)
    tmp = _temporary(target.parent, target.name)
    try:
        yield tmp
        with contextlib.suppress(OSError):  # as cp keeps them
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise _write_error(target, e) from None
        raise
    finally:
        _OPEN.discard(str(tmp))


@contextlib.contextmanager
def folder_output(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty hidden folder inside ``out`` (made if missing); on success ``os.replace`` each entry into
    ``out`` and, with ``overwrite``, remove what else ``out`` held. On any exception only the temporary goes
    (and ``out``, if this made it).

    Raises:
        OutputExistsError: ``out`` holds files (other than dead temporaries) and ``overwrite`` is false.
        CheckpointError: ``out`` is a file, not UTF-8, or is or holds the current folder.
    """
    check_name(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; pass a folder path")
    real = out.resolve()  # the folder itself, through links and ``..``
    if real.is_dir() and Path.cwd().is_relative_to(real):
        raise CheckpointError(
            f"{out} is or holds the current folder, which replacing it would delete; pass another folder"
        )
    remove_stale(real, real.name)
    if real.is_dir() and not overwrite and any(real.iterdir()):
        raise OutputExistsError(f"{out} exists and is not empty; pass {option('overwrite')} to replace it")
    created = not real.exists()
    tmp = _temporary(real, real.name)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        written = {p.name for p in tmp.iterdir()}
        for p in real.iterdir():
            if (overwrite or p.name in written) and not _TEMPORARY.fullmatch(p.name):
                _remove(p)  # what this export replaces, and with overwrite an earlier export's other files
        for p in tmp.iterdir():
            os.replace(p, real / p.name)
        tmp.rmdir()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(real, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(out, e) from None
        raise
    finally:
        _OPEN.discard(str(tmp))
