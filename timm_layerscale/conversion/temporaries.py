"""Temporary files and folders of writers, and removing those whose writer was killed.

A writer builds its output under a hidden name next to the target,
``.{name}.tmp-{pid}-{hex}``, and moves it onto the target when complete. While it
lives it holds an exclusive ``flock`` on its temporary; the kernel drops that lock
when the process ends, however it ends (``SIGKILL`` included). So a temporary that
can be locked, of a process that no longer runs, was left by a writer that died,
and :func:`remove_stale_temporaries` removes it; one whose lock is held belongs to a
live writer and is never touched. Where ``fcntl`` is missing (Windows) the process
id in the name is the only guard.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path

if sys.platform != "win32":
    import fcntl
else:
    fcntl = None

from ..errors import CheckpointError

__all__ = ["create_temporary", "remove_stale_temporaries"]


# Hidden, and matched by the Hub upload's ignore pattern ``.*.tmp-*``.
def _temporary_name(target: Path) -> Path:
    return target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists; ``True`` when that cannot be told."""
    if sys.platform == "win32":
        import ctypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: it exists
        code = ctypes.c_ulong()
        alive = not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)) or code.value == 259  # STILL_ACTIVE
        kernel32.CloseHandle(handle)
        return alive
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
    """Remove the temporary ``path`` made by process ``pid`` if its writer is gone.

    A writer holds an exclusive lock on its temporary while it lives, which the
    kernel drops when the process ends, however it ends. The temporary is stale when
    that lock can be taken and ``pid`` no longer runs (or is this process, whose
    own writers hold their locks too). Without locks (Windows, or a filesystem that
    refuses them) only a dead ``pid`` makes it stale.
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
    """Remove the temporaries that writers of ``target`` left when they were killed.

    A writer that is killed (``SIGKILL``, power loss of the process, an out-of-memory
    kill) cannot delete its ``.{name}.tmp-{pid}-{hex}`` file or folder; the next
    write of the same ``target`` calls this. A temporary whose writer still runs, in
    this process or another, is never touched.

    Returns:
        The temporaries removed.
    """
    target = Path(target)
    pattern = re.compile(re.escape(f".{target.name}.tmp-") + r"([0-9]+)-[0-9a-f]+")
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
