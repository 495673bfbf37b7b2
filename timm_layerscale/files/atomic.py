"""Atomic writes: a temporary next to the target, moved onto it only when complete.

A writer builds its output under a hidden name, ``.{name}.tmp-{pid}-{hex}`` (a hash in place
of a name too long to take the suffix), and
holds an exclusive ``flock`` on it while it lives; the kernel drops that lock when
the process ends, however it ends (``SIGKILL`` included). So a temporary that can be
locked, of a process that no longer runs, was left by a writer that died, and
:func:`remove_stale_temporaries` removes it; a live writer's is never touched. Where
``fcntl`` is missing (Windows) no temporary is taken for stale.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.platform != "win32":
    import fcntl
else:
    fcntl = None

from ..errors import CheckpointError, OutputExistsError

__all__ = [
    "atomic_output",
    "check_name",
    "check_output",
    "check_output_folder",
    "clear_folder",
    "create_temporary",
    "file_path",
    "fills_in_place",
    "keep_mode",
    "no_follow",
    "remove_stale_temporaries",
    "temporary_folder",
    "write_target",
]


def hidden_prefix(target: Path) -> str:
    """``.{name}`` of ``target``, the start of its hidden siblings' names; a name too long to take
    a suffix within a file name's 255 bytes is replaced by a hash of it."""
    name = target.name
    if len(os.fsencode(name)) > 200:
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return f".{name}"


# Hidden, and matched by the Hub upload's ignore pattern ``.*.tmp-*``.
def _temporary_name(target: Path) -> Path:
    return target.parent / f"{hidden_prefix(target)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists; ``True`` when that cannot be told (always on Windows)."""
    if sys.platform == "win32":  # os.kill would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def _try_lock(fd: int) -> bool | None:
    """Try an exclusive ``flock`` on ``fd``: ``True`` taken, ``False`` held elsewhere, ``None`` not supported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _remove_if_stale(path: Path, pid: int) -> bool:
    """Remove the temporary ``path`` of process ``pid`` if its lock can be taken and ``pid`` is gone (or is us).

    Without locks (a filesystem that refuses them) only a dead ``pid`` makes it stale.
    """
    own = pid == os.getpid()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # gone, a link, or not ours to read: leave it
        return False
    try:
        before = os.fstat(fd)
        locked = _try_lock(fd)
        if locked is False or (locked is None and own) or (not own and _pid_alive(pid)):
            return False
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(path, follow_symlinks=False), before):
                if stat.S_ISDIR(before.st_mode):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                return True
        return False
    finally:
        os.close(fd)


def remove_stale_temporaries(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that killed writers of ``target`` left; return them.

    The next write of the same ``target`` calls this. A temporary whose writer still
    runs, in this process or another, is never touched.
    """
    target = Path(target)
    pattern = re.compile(re.escape(f"{hidden_prefix(target)}.tmp-") + r"([0-9]+)-[0-9a-f]+")
    try:
        names = [e.name for e in os.scandir(target.parent)]
    except OSError:
        return []
    removed = []
    for name in names:
        if (m := pattern.fullmatch(name)) and _remove_if_stale(target.parent / name, int(m.group(1))):
            removed.append(target.parent / name)
    return removed


def create_temporary(target: Path, folder: bool = False) -> tuple[Path, int | None]:
    """Create an empty temporary file (or folder) for ``target``; return it and the descriptor holding its lock."""
    while True:
        tmp = _temporary_name(target)
        try:
            if folder:
                os.mkdir(tmp)
                fd = os.open(tmp, os.O_RDONLY) if fcntl is not None else None
            else:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            what = "folder" if folder else "file"
            raise CheckpointError(
                f"cannot create a {what} in {target.parent} ({e.strerror}); choose another output path"
            ) from None
        if fcntl is None:
            if fd is not None:
                os.close(fd)
            return tmp, None
        _try_lock(fd)
        try:  # a cleaner may have removed it before the lock was taken: start again
            if os.path.samestat(os.stat(tmp, follow_symlinks=False), os.fstat(fd)):
                return tmp, fd
        except OSError:
            pass
        os.close(fd)


def check_name(path: Path) -> None:
    """Raise :class:`~timm_layerscale.errors.CheckpointError` unless ``path`` is valid UTF-8: PyTorch and
    safetensors open no other names."""
    try:
        str(path).encode()
    except UnicodeEncodeError:
        raise CheckpointError(
            f"{str(path)!r} is not a UTF-8 name, which PyTorch and safetensors cannot open; use a name in UTF-8"
        ) from None


def no_follow(path: str, flags: int) -> int:
    """An opener for ``open`` that refuses a link as the last part of ``path``: a temporary that
    someone who may write its folder swapped for a link to another file is not written through."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)


def file_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refused where it ends in a slash: that names a folder,
    which ``Path`` would drop (``cp`` refuses such a name too)."""
    if os.fspath(path).endswith(("/", os.sep)):
        raise CheckpointError(
            f"output {os.fspath(path)} ends in a slash, which names a folder; pass a file path such as {Path(path)}"
        )
    return Path(path)


def check_output(target: Path, overwrite: bool) -> None:
    """Raise unless ``target`` can be written as a new file (or replaced, with ``overwrite``).

    Raises:
        OutputExistsError: ``target`` exists and ``overwrite`` is false.
        CheckpointError: ``target`` is a directory or another file that is not a regular one (a
            device such as ``/dev/null``, a pipe), its name is not valid UTF-8, or its folder is
            missing or not writable.
    """
    check_name(target)
    if target.is_dir():
        raise CheckpointError(
            f"output {target} is a directory; pass a file path such as {target / 'model.safetensors'}"
        )
    if target.exists() and not target.is_file():  # renaming onto it would replace the device or pipe
        raise CheckpointError(f"output {target} is not a regular file (a device or a pipe); pass a file path")
    if target.exists() and not overwrite:
        raise OutputExistsError(f"output {target} exists; pass overwrite=True to replace it")
    parent = target.parent
    if not parent.is_dir():
        raise CheckpointError(f"output folder {parent} does not exist; create it or choose another output path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"output folder {parent} is not writable; choose another output path")


# link(2) errors meaning "this filesystem has no hard links", not "the target exists".
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def check_output_folder(out: Path, overwrite: bool) -> Path:
    """Raise unless ``out`` can be written as a folder: not a file, and empty unless ``overwrite``.

    Returns:
        The folder to write: ``out``, or the folder it leads to when it is a symbolic link
        (replacing the link would leave its folder as it was) or its last part is ``..``
        (whose temporary sibling and name would be those of the folder below).

    Raises:
        CheckpointError: ``out`` is a file, not a valid UTF-8 name, or the current folder or
            one holding it (replacing it would delete the folder a shell stands in).
        OutputExistsError: ``out`` holds files and ``overwrite`` is false.
    """
    if out.name == ".." or out.is_symlink():
        out = out.resolve()
    check_name(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; pass a folder path")
    if out.is_dir() and Path.cwd().is_relative_to(out.resolve()):
        raise CheckpointError(
            f"{out} is or holds the current folder, which replacing it would delete; pass another folder"
        )
    if out.is_dir() and not overwrite:
        if fills_in_place(out):  # an export's temporary lies inside: those of killed exports do not count
            remove_stale_temporaries(out / out.name)
        if any(out.iterdir()):
            raise OutputExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    return out


def fills_in_place(out: Path) -> bool:
    """Whether the folder ``out`` must be written from inside: it is a mount point (a container's
    volume), which no rename can replace, or its parent folder is not writable, so that no sibling
    can be made."""
    return out.is_dir() and (os.path.ismount(out) or not os.access(out.absolute().parent, os.W_OK | os.X_OK))


def clear_folder(folder: Path, keep: Path | None = None) -> None:
    """Delete everything ``folder`` holds but ``keep``, and not the folder itself (a mount point,
    as a container's volume is, cannot be removed or renamed)."""
    for p in folder.iterdir():
        if p == keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def keep_mode(new: Path, old: Path, writing: bool = False) -> None:
    """Give ``new`` the permission bits, owner and group of ``old``, which it is to replace, as
    writing into ``old`` would keep them: a file or folder made private stays private, and one
    that root replaces (in a container, on a user's volume) stays the user's; where the system
    refuses the owner or group (only root may give a file away), ``new`` keeps its own. While
    ``writing``, no more than ``new``'s own bits and the owner's, so that no one else opens it
    meanwhile. Nothing if ``old`` is gone, or where a link has taken ``new``'s place: ``new`` is
    changed through a descriptor opened without following links, never by name."""
    with contextlib.suppress(OSError):
        before = os.stat(old)
        fd = os.open(new, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            now = os.fstat(fd)
            if hasattr(os, "fchown") and (before.st_uid, before.st_gid) != (now.st_uid, now.st_gid):
                with contextlib.suppress(OSError):
                    os.fchown(fd, before.st_uid, before.st_gid)
            mode = stat.S_IMODE(before.st_mode)
            if writing:
                mode = mode & stat.S_IMODE(now.st_mode) | stat.S_IRWXU
            os.chmod(fd if os.chmod in os.supports_fd else new, mode)
        finally:
            os.close(fd)


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` onto ``target``; without ``overwrite``, never replace a file.

    ``os.link`` fails atomically when ``target`` exists, so of two racing writers one
    wins and the other gets :class:`OutputExistsError`. Without hard links, the check
    and ``os.replace`` are two steps: a short window for another process.
    """
    if overwrite:
        keep_mode(tmp, target)
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputExistsError(f"output {target} exists; pass overwrite=True to replace it") from None
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
        check_output(target, overwrite)
        os.replace(tmp, target)
        return
    with contextlib.suppress(OSError):  # the output is complete; only a failing unlink keeps this name
        tmp.unlink()


#: Lock descriptors of the temporary folders made by :func:`temporary_folder`, while they keep their names.
_FOLDER_LOCKS: dict[Path, int] = {}


def temporary_folder(target: str | os.PathLike[str]) -> Path:
    """Create a temporary folder next to ``target`` (stale ones removed first); the caller moves or deletes it.

    It stays locked while this process lives and it keeps its name, so no other
    writer takes it for stale.

    Raises:
        CheckpointError: The folder cannot be created.
    """
    for held, fd in list(_FOLDER_LOCKS.items()):
        try:
            current = os.stat(held, follow_symlinks=False)
        except OSError:
            current = None
        if current is None or not os.path.samestat(current, os.fstat(fd)):
            os.close(_FOLDER_LOCKS.pop(held))
    target = Path(target)
    remove_stale_temporaries(target)
    tmp, lock = create_temporary(target, folder=True)
    keep_mode(tmp, target, writing=True)
    if lock is not None:
        _FOLDER_LOCKS[tmp] = lock
    return tmp


def write_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: the one a symbolic link leads to (``open`` writes
    through a link), else ``path`` itself."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it onto ``path`` on success.

    The temporary is created empty; the caller writes it by name. On any exception,
    ``KeyboardInterrupt`` included, it is deleted and ``path`` is left as it was.
    Without ``overwrite`` an existing file is never replaced, even one another process
    wrote meanwhile; either way ``path`` holds one whole file, never a mix. Protects
    against failure of this process, not against power loss (no ``fsync``). A symbolic
    link is written through, as ``open`` writes: the file it leads to is replaced, the link stays.
    A replaced file's permissions are kept; a new file gets those the umask gives.

    Args:
        path: The final file.
        overwrite: Replace ``path`` if it exists.

    Raises:
        OutputExistsError: ``path`` exists (checked before writing, and atomically
            when the finished file is put in place) and ``overwrite`` is false.
        CheckpointError: ``path`` is a directory, a device or a pipe, its folder is missing
            or not writable, or writing failed (for example, disk full).
    """
    typed = file_path(path)
    check_output(typed, overwrite)
    target = write_target(typed)
    if target != typed:  # a link: the file it leads to is checked too
        check_output(target, overwrite)
    remove_stale_temporaries(target)
    tmp, lock = create_temporary(target)
    keep_mode(tmp, target, writing=True)
    try:
        yield tmp
        check_output(target, overwrite)
        _publish(tmp, target, overwrite)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointError(
                f"writing {target} failed ({e.strerror or e}); nothing was written, free space or choose another path"
            ) from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
