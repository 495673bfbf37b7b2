"""Reading checkpoint files.

:func:`load_checkpoint` opens PyTorch files with ``weights_only=True`` and memory-maps
them, and opens safetensors files lazily (:class:`LazySafetensors`).
The checks made on what was read live here too: the file's hash, checksums and identity,
and finite values. Bad input raises :class:`~timm_layerscale.errors.CheckpointError` with a
one-line message saying what is wrong and what to do. Writing is in
:mod:`~timm_layerscale.files.save`.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import mmap
import os
import re
import struct
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from .atomic import check_name

__all__ = [
    "LazySafetensors",
    "check_checksums",
    "check_finite",
    "check_unchanged",
    "file_identity",
    "load_checkpoint",
    "nonfinite_tensors",
    "parse_dtype",
    "release_pages",
    "sha256_file",
]

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
_CHUNK = 1 << 20  # bytes per read when hashing
_ZIP_MAGIC = b"PK\x03\x04"

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


class LazySafetensors(Mapping[str, torch.Tensor]):
    """Read-only mapping over a safetensors file that reads a tensor when it is indexed.

    Keys are in file order. The file stays open until :meth:`close` (or garbage collection).

    Attributes:
        path: The file.
        metadata: The file's ``__metadata__`` (string to string; empty when absent).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = safe_open(str(path), framework="pt", device="cpu")
        keys = self._file.offset_keys() if hasattr(self._file, "offset_keys") else self._file.keys()
        self._keys: tuple[str, ...] = tuple(keys)
        self._known = frozenset(self._keys)
        self.metadata: dict[str, str] = dict(self._file.metadata() or {})

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._known:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def close(self) -> None:
        """Release the file; indexing afterwards fails."""
        self._file.__exit__(None, None, None)

    def __repr__(self) -> str:
        return f"LazySafetensors({str(self.path)!r}, {len(self)} tensors)"


def _readable_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    check_name(p)
    if p.is_dir():
        raise CheckpointError(f"{p} is a directory, not a checkpoint; pass the .pth or .safetensors file inside it")
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} not found; check the path")
    if not p.is_file():
        raise CheckpointError(f"{p} is not a regular file (a device or a pipe); pass a checkpoint file")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{p} is empty (0 bytes); download or copy it again")
    if not os.access(p, os.R_OK):
        raise CheckpointError(f"cannot read {p}: permission denied; fix its permissions")
    return p


def _sniff(head: bytes, size: int) -> str | None:
    """Return 'zip', 'pickle', 'safetensors' or None from a file's first bytes."""
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if len(head) > 8 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= size - 8:
        return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    return None


def _text_error(p: Path, head: bytes) -> CheckpointError | None:
    if b"\x00" in head:
        return None
    text = head.decode("utf-8", errors="replace")
    if sum(c.isprintable() or c in "\r\n\t" for c in text) < 0.95 * len(text):
        return None
    if text.startswith("version https://git-lfs"):
        return CheckpointError(f"{p} is a Git LFS pointer, not the weights; fetch the real file (git lfs pull)")
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return CheckpointError(f"{p} is a text file, not a checkpoint (it starts with {first!r}); download it again")


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint without running code from it.

    PyTorch files (``.pth``, ``.pt``, ``.bin``, ``.ckpt``) are read with
    ``torch.load(map_location="cpu", weights_only=True)``, memory-mapped unless
    they use the legacy (non-zip) format. Safetensors files are opened lazily. The
    format comes from the file's first bytes; the suffix only decides when those
    are not recognised.

    Args:
        path: The checkpoint file.

    Returns:
        For PyTorch files, the top-level dict as saved (tensors on CPU, memory-mapped).
        For safetensors files, a :class:`LazySafetensors` mapping.

    Raises:
        CheckpointError: The file is missing, not named in UTF-8, a directory, empty,
            truncated, text, of unknown format, holds objects other than tensors and
            containers, or its top level is not a dict.
    """
    p = _readable_file(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(512)
    kind = _sniff(head, size)
    suffix = p.suffix.lower()
    if kind is None:
        error = _text_error(p, head)
        if error is not None:
            raise error
        if suffix in TORCH_SUFFIXES:
            raise CheckpointError(
                f"{p} is not a PyTorch checkpoint (unrecognised contents); it may be corrupt, download it again"
            )
        if suffix != ".safetensors":
            raise CheckpointError(f"cannot tell the format of {p}; expected a PyTorch (.pth) or safetensors file")
        kind = "safetensors"
    if kind == "safetensors":
        try:
            return LazySafetensors(p)
        except SafetensorError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{p} is not a valid safetensors file ({reason}); it may be truncated, download it again"
            ) from None
    try:
        # Training checkpoints often carry their argparse.Namespace of options; it holds
        # plain values only, so it is allowed beside tensors.
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(p, map_location="cpu", weights_only=True, mmap=kind == "zip")
    except Exception as e:  # torch raises several unrelated types for bad files
        message = str(e)
        if "Weights only load failed" in message:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", message)
            what = f" ({found.group(1)})" if found else ""
            raise CheckpointError(
                f"{p} contains code or objects that are not tensors{what} and was not loaded; "
                "use a checkpoint that holds only tensors, or re-save its state dict where you trust the file"
            ) from None
        first = re.split(r"(?<=\.)\s", message.strip())[0][:160] if message.strip() else type(e).__name__
        raise CheckpointError(
            f"{p} could not be read ({first}); it may be truncated or corrupt, download it again"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{p} holds a {type(obj).__name__}, not a dict; expected a state dict or a dict with a 'model' entry"
        )
    return obj


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the SHA-256 of a file as 64 lowercase hex digits, reading 1 MiB at a time."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"cannot hash {p}: no such file; check the path")
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(p, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def check_checksums(path: str | os.PathLike[str]) -> None:
    """Check each record of a PyTorch zip file against its CRC-32, reading the file once more.

    ``torch.load`` does not check them, so a file damaged inside (bytes overwritten or zeroed,
    not cut short) loads with wrong weights. Records saved without a checksum (CRC 0, as
    torch writes them when its ``compute_crc32`` option is off) are skipped; other formats
    carry no checksums and pass.

    Raises:
        CheckpointError: A record's contents do not match its CRC-32.
    """
    with open(path, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.CRC:
                    with z.open(info) as record:  # raises at the end of a record that fails
                        while record.read(_CHUNK):
                            pass
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path} is corrupt ({e}); download it again") from None


def file_identity(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """What changes when a file is rewritten or replaced: device, inode, size, mtime, ctime.

    Returns ``None`` when the file cannot be stat'ed.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_unchanged(path: str | os.PathLike[str], before: tuple[int, ...] | None) -> None:
    """Raise if ``path`` is no longer the file :func:`file_identity` saw.

    Taken before a file is first read and checked after it was last read, this proves
    that everything read in between (tensors, hash) came from one version of the file:
    another process that rewrote it in place changes its size or times, one that
    replaced it changes its inode. A rewrite that keeps the size and lands within the
    timestamp granularity of the previous change (coarse on some filesystems) is
    the case this cannot see.

    Raises:
        CheckpointError: The file changed, was replaced or is gone.
    """
    if before is None or file_identity(path) != before:
        raise CheckpointError(
            f"{path} changed while it was being read (another process wrote it); convert again once it is complete"
        )


def nonfinite_tensors(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[str]:
    """The names of the floating-point tensors that hold NaN or Inf, in order; with ``dtype``,
    once cast to it (a finite value beyond its range becomes Inf).

    Tensors are checked one at a time in chunks of 2**24 elements, so extra memory
    is bounded by one chunk; pages of memory-mapped tensors are released once checked.
    Non-floating tensors are skipped.
    """
    bad: list[str] = []
    for name, tensor in state_dict.items():
        if not (isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex())):
            continue
        flat = tensor.detach().reshape(-1)
        for i in range(0, flat.numel(), 1 << 24):
            chunk = flat[i : i + (1 << 24)]
            if dtype is not None and chunk.is_floating_point():
                chunk = chunk.to(dtype)
            if chunk.dtype.itemsize == 1:  # torch has no aminmax for 8-bit floats; they widen exactly
                chunk = chunk.to(torch.float32)
            if chunk.is_complex():
                chunk = torch.view_as_real(chunk)
            lo, hi = torch.aminmax(chunk)  # one pass, no mask (isfinite's takes 3-5x as long): NaN reaches both
            if not bool(lo.isfinite() & hi.isfinite()):
                bad.append(name)
                break
        release_pages(tensor)
    return bad


def check_finite(
    state_dict: Mapping[str, torch.Tensor],
    source: str | os.PathLike[str] | None = None,
    advice: str = "check the source checkpoint, or pass allow_nonfinite=True to convert anyway",
) -> None:
    """Raise if any floating-point tensor holds NaN or Inf (:func:`nonfinite_tensors`).

    Args:
        state_dict: Name to tensor.
        source: The file the state dict came from, named at the start of the message.
        advice: What the message tells the caller to do.

    Raises:
        CheckpointError: Naming the first non-finite tensor and how many there are.
    """
    if bad := nonfinite_tensors(state_dict):
        where = f"{source}: " if source is not None else ""
        raise CheckpointError(f"{where}{len(bad)} tensor(s) contain NaN or Inf, first {bad[0]!r}; {advice}")


@functools.cache
def _madvise() -> Any:
    if not (sys.platform.startswith("linux") and os.access("/proc/self/pagemap", os.R_OK)):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def release_pages(tensor: torch.Tensor) -> None:
    """Take a memory-mapped tensor's pages out of this process's resident set (Linux; elsewhere nothing).

    Every page of a mapped checkpoint that was read counts in the resident set until
    it is unmapped, so a pass over a large file would hold all of it. The pages are
    dropped (``MADV_DONTNEED``; they stay in the page cache) only when none of them
    holds data that exists nowhere else: ``/proc/self/pagemap`` shows a page of
    ordinary memory, or of a mapped file that was written to (a private copy), as
    present and not a file page, and such a page moved to swap as swapped; dropping
    either would lose its contents.
    """
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    length = tensor.data_ptr() + tensor.nbytes - start
    count = -(-length // page)
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            pagemap.seek(start // page * 8)
            flags = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
    except OSError:
        return
    if len(flags) == count and not _holds_private(flags):
        madvise(start, length, 4)  # MADV_DONTNEED


def _holds_private(flags: np.ndarray) -> bool:
    """Whether any of these pagemap entries is a page whose data only this process
    has: in swap (bit 62), or present (bit 63) and not a file page (bit 61)."""
    swapped = (flags >> 62) & 1
    present_not_file = (flags >> 63) & ~(flags >> 61) & 1
    return bool((swapped | present_not_file).any())


def parse_dtype(name: str) -> torch.dtype:
    """Return the torch dtype for ``'fp32'``, ``'fp16'`` or ``'bf16'`` (or ``'float32'``, ``'half'``, ...)."""
    try:
        return _DTYPE_NAMES[name.strip().lower()]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; use fp32, fp16 or bf16") from None
