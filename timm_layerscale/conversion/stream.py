"""One pass over a source file: its SHA-256, the NaN/Inf check and, for a plain copy, the output.

A conversion without verification needs three things of the source file: its SHA-256
(recorded in the output), proof that no tensor holds NaN or Inf, and the tensors
themselves. Tensors that :func:`~timm_layerscale.conversion.io.load_checkpoint`
memory-maps from a PyTorch zip file or a safetensors file are runs of the file's
bytes; :class:`SourcePass` finds each run (:func:`~timm_layerscale.conversion.source_map.map_source`) and then goes through
the file once, start to end, in 8 MiB pieces of one read-only mapping. Each piece is
hashed in a second thread (``hashlib`` releases the GIL), the floating-point tensors
in it are checked, and, when the output is a plain copy (safetensors, no cast), their
bytes are copied to their place in the output, whose header follows from shapes and
dtypes alone: file to file by the kernel (``copy_file_range``, as ``cp`` copies), or
written from the mapping where the kernel cannot. Pieces leave the resident set once
done. The output is byte-identical to what
:func:`~timm_layerscale.conversion.save.save_safetensors` writes for the same tensors.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import mmap
import os
import sys
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import progress
from ..errors import CheckpointError
from .atomic import atomic_output
from .io import MADV_POPULATE_READ, all_finite, nonfinite_error
from .save import safetensors_header, safetensors_plan
from .source_map import Run, SourceMap, map_source

__all__ = ["SourcePass"]

_PIECE = 8 << 20  # bytes of the mapping handled at a time; a multiple of every element size
_IN_FLIGHT = 4  # pieces mapped at once: handled here, not yet hashed by the hashing thread
_SUMMABLE = {torch.float32: None, torch.float64: None, torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _advise(source: Any, advice: int, start: int, end: int) -> None:
    if isinstance(source, mmap.mmap):
        with contextlib.suppress(OSError):  # only advice
            source.madvise(advice, start, end - start)


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _changed(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} changed while it was being read (another process wrote it); convert again once it is complete"
    )


# copy_file_range errors meaning "not between these files", not "the copy failed".
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


class _Copier:
    """Copies runs of the source file into the output at given offsets.

    The kernel copies file to file where it can (``copy_file_range``, as ``cp`` does,
    without a pass through this process's memory); elsewhere, or between filesystems
    that refuse it, the bytes are written from the mapping.
    """

    def __init__(self, path: Path, source: int, view: memoryview, output: int) -> None:
        self._path, self._source, self._view, self._output = path, source, view, output
        self._kernel = hasattr(os, "copy_file_range")

    def __call__(self, start: int, stop: int, dst: int) -> None:
        while self._kernel and start < stop:
            try:
                n = os.copy_file_range(self._source, self._output, stop - start, start, dst)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel = False
                break
            if n == 0:  # the source ends early
                raise _changed(self._path)
            start, dst = start + n, dst + n
        if start < stop:
            _pwrite_all(self._output, self._view[start:stop], dst)


def _finite(t: torch.Tensor) -> bool:
    # A sum is finite only if every term is; a sum that overflows gets the closer look.
    return (t.dtype in _SUMMABLE and bool(torch.isfinite(t.sum(dtype=_SUMMABLE[t.dtype])))) or all_finite(t)


class SourcePass:
    """The source file read once: hashed, checked for NaN/Inf and, for a plain copy, written out.

    Build one with :meth:`prepare`; then either :meth:`run` (hash and check) or
    :meth:`copy_to_safetensors` (hash, check and write in the same pass).
    """

    def __init__(self, source: SourceMap, checks: list[Run], names: list[str]) -> None:
        self._source, self._checks, self._names = source, checks, names

    @classmethod
    def prepare(
        cls, path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor], *, check: bool = True
    ) -> SourcePass | None:
        """Plan a pass over ``path`` for ``state_dict`` memory-mapped from it; ``None`` where none applies.

        Args:
            path: The file the tensors were loaded from.
            state_dict: Its tensors, by the names an error should give.
            check: Check the floating-point tensors for NaN and Inf.
        """
        if sys.byteorder != "little":
            return None
        source = map_source(path, state_dict)
        if source is None:
            return None
        checks: list[Run] = []
        names: list[str] = []
        for name, t in state_dict.items():
            if check and (t.is_floating_point() or t.is_complex()) and t.numel():
                offset, nbytes = source.locate(t) or (0, 0)  # located: map_source found every tensor
                checks.append(Run(offset, offset + nbytes, t.dtype, len(names)))
                names.append(name)
        return cls(source, checks, names)

    def can_copy(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> bool:
        """Whether :meth:`copy_to_safetensors` can write ``tensors`` (cast to ``dtype``) from the file's bytes."""
        for t in tensors.values():
            if self._source.locate(t) is None:
                return False
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                return False
        return True

    def run(self) -> str:
        """Hash the file and check its tensors.

        Returns:
            The file's SHA-256 as 64 lowercase hex digits.

        Raises:
            CheckpointError: A tensor holds NaN or Inf (named as
                :func:`~timm_layerscale.conversion.io.check_finite` names it), or the
                file changed size.
        """
        name = self._source.path.name
        with progress.bar(total=self._source.size, desc=f"reading {name}", unit="B", unit_scale=True) as bar:
            return self._pass([], -1, bar)

    def copy_to_safetensors(
        self,
        output: str | os.PathLike[str],
        tensors: Mapping[str, torch.Tensor],
        metadata: dict[str, str],
        *,
        digest_key: str,
        overwrite: bool = False,
    ) -> str:
        """Write ``tensors`` as a safetensors file in the same pass that hashes and checks the source.

        Args:
            output: The safetensors file, written atomically
                (:func:`~timm_layerscale.conversion.atomic.atomic_output`).
            tensors: Name to tensor, each located in the source (:meth:`can_copy`).
            metadata: The header's metadata; ``metadata[digest_key]`` is set to the
                source's SHA-256 once the pass has computed it.
            digest_key: The metadata key of the source's SHA-256.
            overwrite: Replace ``output`` if it exists.

        Returns:
            The source's SHA-256.

        Raises:
            CheckpointError: As :meth:`run`, or a tensor cannot be stored, or writing failed.
        """
        target = Path(output)
        plan = safetensors_plan(tensors, None)
        metadata[digest_key] = "0" * 64
        head, ends = safetensors_header(plan, metadata)
        writes = []
        for (name, _, _), end in zip(plan, ends, strict=True):
            located = self._source.locate(tensors[name])
            if located is None:
                raise CheckpointError(f"tensor {name!r} is not one run of {self._source.path}; save it another way")
            offset, nbytes = located
            if nbytes:
                writes.append(Run(offset, offset + nbytes, tensors[name].dtype, len(head) + end - nbytes))
        with (
            atomic_output(target, overwrite) as tmp,
            progress.bar(total=self._source.size, desc=f"writing {target.name}", unit="B", unit_scale=True) as bar,
        ):
            fd = os.open(tmp, os.O_WRONLY)
            try:
                digest = self._pass(writes, fd, bar)
                metadata[digest_key] = digest
                final, _ = safetensors_header(plan, metadata)
                if len(final) != len(head):
                    raise CheckpointError(f"the header of {target} changed size; report this bug")
                _pwrite_all(fd, final, 0)
            finally:
                os.close(fd)
        return digest

    def _pass(self, writes: list[Run], fd: int, bar: Any) -> str:
        """Read the source once: hash it, check ``self._checks``, copy ``writes`` into ``fd``; return the hash."""
        with open(self._source.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._source.size:
                raise _changed(self._source.path)
            source = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self._source.size else b""
            try:
                return self._scan(f.fileno(), source, writes, fd, bar)
            finally:
                if isinstance(source, mmap.mmap):
                    with contextlib.suppress(BufferError):  # else it closes when its last view goes
                        source.close()

    def _scan(self, source_fd: int, source: Any, writes: list[Run], fd: int, bar: Any) -> str:
        digest = hashlib.sha256()
        bad: set[int] = set()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the checks are fast on one core; a second thread would take the hashing's
        try:
            with ThreadPoolExecutor(1) as hasher:
                with warnings.catch_warnings():  # torch warns that the mapping is read-only: nothing writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    data = (
                        torch.frombuffer(source, dtype=torch.uint8)
                        if len(source)
                        else torch.empty(0, dtype=torch.uint8)
                    )
                self._read(source, source_fd, data, hasher, digest, writes, fd, bad, bar)
                del data
        finally:
            torch.set_num_threads(threads)
        if bad:
            raise nonfinite_error([self._names[j] for j in sorted(bad)])
        return digest.hexdigest()

    def _read(
        self,
        source: Any,
        source_fd: int,
        data: torch.Tensor,
        hasher: ThreadPoolExecutor,
        digest: Any,
        writes: list[Run],
        fd: int,
        bad: set[int],
        bar: Any,
    ) -> None:
        """The loop of :meth:`_pass`, piece by piece through the mapped file."""
        runs = [(r.start, False, r) for r in self._checks] + [(r.start, True, r) for r in writes]
        runs.sort(key=lambda item: item[0])
        view = memoryview(source)
        copy = _Copier(self._source.path, source_fd, view, fd)
        hashing: collections.deque[tuple[int, int, Future[None]]] = collections.deque()
        active: list[tuple[int, bool, Run]] = []  # runs that began before the end of the current piece
        upcoming = 0
        try:
            for pos in range(0, len(view), _PIECE):
                end = min(pos + _PIECE, len(view))
                _advise(source, MADV_POPULATE_READ, pos, end)  # map the piece's pages in one call
                hashing.append((pos, end, hasher.submit(digest.update, view[pos:end])))
                while upcoming < len(runs) and runs[upcoming][0] < end:
                    active.append(runs[upcoming])
                    upcoming += 1
                for _, write, run in active:
                    a, b = max(run.start, pos), min(run.stop, end)
                    if write:
                        copy(a, b, run.index + a - run.start)
                    elif run.index not in bad and not _finite(data[a:b].view(run.dtype)):
                        bad.add(run.index)
                active = [item for item in active if item[2].stop > end]
                bar.update(end - pos)
                while len(hashing) > _IN_FLIGHT or (hashing and end == len(view)):
                    done_pos, done_end, future = hashing.popleft()
                    future.result()
                    _advise(source, mmap.MADV_DONTNEED, done_pos, done_end)  # out of the resident set
        finally:
            for _, _, future in hashing:
                future.cancel()
            hashing.clear()
            view.release()
