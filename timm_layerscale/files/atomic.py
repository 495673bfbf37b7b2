"""Atomic writes: a hidden temporary ``.{name}.tmp-{hex}`` beside the output, renamed onto it when complete. Its
writer holds an exclusive ``flock`` on it; the kernel drops a dead writer's lock (in any container on the host), so
the next write of the output removes the temporaries it can lock. Without ``overwrite`` the output is placed by a
hard link, or where the filesystem has none by a rename onto a name claimed by an exclusive create. A folder is
built beside the old one and swapped in by renames (the old one aside as ``.{name}.old-{hex}``, then removed), so
that an interruption leaves the complete old or new folder, or after a kill between the renames the old one aside,
which the next write moves back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CheckpointError, OutputExistsError, option

__all__ = ["atomic_output", "check_name", "folder_output", "output_path", "remove_stale"]

_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]+")


def _hidden(folder: Path, name: str, kind: str = "tmp") -> Path:
    return folder / f".{name}.{kind}-{secrets.token_hex(4)}"


def _lock(path: Path) -> int | None:
    """An open descriptor of ``path`` (a file or a folder) holding its exclusive lock; ``None`` while another holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_stale(folder: Path, name: str) -> None:
    """Remove the temporaries of ``folder / name`` that no living writer holds; move back the old folder a killed
    swap left aside where ``name`` itself is missing, and remove it where the new one is in place."""
    with contextlib.suppress(OSError):
        for p in sorted(folder.iterdir(), key=lambda p: p.name):
            m = _TEMPORARY.fullmatch(p.name)
            if not m or m["name"] != name or (fd := _lock(p)) is None:
                continue
            try:
                if m["kind"] == "old" and not (folder / name).exists():
                    os.replace(p, folder / name)
                else:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            finally:
                os.close(fd)


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
    if _stale_claim(target):  # a write killed between claiming the name and its rename
        target.unlink()
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


#: What a claimed output name holds until the finished file is renamed onto it (where hard links are refused).
CLAIM = b"timm-layerscale: a write in progress claims this name\n"
#: What ``link`` says on a filesystem without hard links (vfat, exFAT, many FUSE mounts), or at a link limit.
NO_LINKS = (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.EMLINK)


def _stale_claim(target: Path) -> bool:
    """Whether ``target`` is the claim of a write killed before its rename: :data:`CLAIM` alone, its lock free."""
    try:
        if target.stat().st_size != len(CLAIM) or target.read_bytes() != CLAIM or (fd := _lock(target)) is None:
            return False
    except OSError:
        return False
    os.close(fd)
    return True


def _put(tmp: Path, target: Path) -> None:
    """Put the finished ``tmp`` at ``target`` without replacing a name that appeared meanwhile: a hard link (then
    ``tmp`` removed), or where the filesystem has none the name claimed by an exclusive create (locked, holding
    :data:`CLAIM`) and ``tmp`` renamed onto the claim; a failed rename removes the claim. ``FileExistsError`` where
    the name is taken."""
    try:
        os.link(tmp, target)
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
    else:
        tmp.unlink()
        return
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a living claim: another run leaves it
        os.write(fd, CLAIM)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise
    finally:
        os.close(fd)


def _place(tmp: Path, target: Path, place: Callable[[], None]) -> None:
    """``place()`` a finished temporary at ``target``; an :class:`OutputExistsError` where that finds it taken."""
    try:
        place()
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise
        raise OutputExistsError(
            f"output {target} appeared while this one was written; pass {option('overwrite')}"
        ) from e


def _write_error(where: Path, e: OSError) -> CheckpointError:
    advice = "free space or choose another path" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "choose another path"
    return CheckpointError(f"writing {where} failed ({e.strerror or e}); nothing was written, {advice}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary file beside ``path`` (created empty, locked) and ``os.replace`` it onto ``path`` on success;
    on any exception, ``KeyboardInterrupt`` included, delete it and leave ``path`` as it was. A symbolic link
    is written through; a replaced file keeps its permission bits. Raises as :func:`output_path`, or
    :class:`~timm_layerscale.errors.CheckpointError` if the write failed (disk full)."""
    target = output_path(path, overwrite)
    remove_stale(target.parent, target.name)
    tmp = _hidden(target.parent, target.name)
    fd = None
    try:
        tmp.touch(exist_ok=False)
        fd = _lock(tmp)
        yield tmp
        if overwrite:
            with contextlib.suppress(OSError):  # as cp keeps them
                os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
            os.replace(tmp, target)
        else:  # never onto an output another writer put there meanwhile, which a rename would replace
            _place(tmp, target, lambda: _put(tmp, target))
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise _write_error(target, e) from None
        raise
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def folder_output(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success swap it in (the old ``out`` moved aside, the new
    one renamed into place, the old one removed). An exception before the swap removes only the temporary; during
    it, the old folder is moved back, or where the new one is in place already, the old one removed.

    Raises:
        OutputExistsError: ``out`` holds files and ``overwrite`` is false.
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
    real.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(real.parent, real.name)
    if real.is_dir() and not overwrite and any(real.iterdir()):
        raise OutputExistsError(f"{out} exists and is not empty; pass {option('overwrite')} to replace it")
    tmp, old = _hidden(real.parent, real.name), _hidden(real.parent, real.name, "old")
    locks: list[int | None] = []
    try:
        tmp.mkdir()
        locks.append(_lock(tmp))
        yield tmp
        if real.is_dir() and overwrite:
            os.chmod(tmp, stat.S_IMODE(real.stat().st_mode))
            locks.append(_lock(real))  # the lock follows the folder aside
            os.replace(real, old)
        # a rename onto a folder succeeds only where it is empty: not where another writer put its output meanwhile
        _place(tmp, real, lambda: os.replace(tmp, real))
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if old.exists() and not real.exists():
            os.replace(old, real)  # back before the new one was in place
        for p in (tmp, old):
            shutil.rmtree(p, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(out, e) from None
        raise
    finally:
        for fd in locks:
            if fd is not None:
                os.close(fd)
