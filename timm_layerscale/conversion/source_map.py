"""Where the memory-mapped tensors of a checkpoint lie in its file.

:func:`~timm_layerscale.conversion.io.load_checkpoint` memory-maps the tensors of a
PyTorch zip file or a safetensors file; each is then a run of the file's bytes.
:func:`map_source` finds those runs (from the zip's records or the safetensors header
and the process's mappings), so that :mod:`.stream` can go through the file once.
Tensors whose pages were changed in memory are refused (``None``), so a caller falls
back to the ordinary path.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .io import private_pages

__all__ = ["Run", "SourceMap", "map_source"]


def _zip_records(path: Path) -> dict[int, int] | None:
    """File offset to size of each stored tensor record (``<archive>/data/<key>``) of a PyTorch zip file."""
    records: dict[int, int] = {}
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) == 2 and parts[1] == "byteorder" and z.read(info).strip() != b"little":
                    return None  # torch.load swaps the bytes of big-endian files in memory
                if len(parts) != 3 or parts[1] != "data" or not info.file_size:
                    continue
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                    return None
                f.seek(info.header_offset)
                local = f.read(30)
                if len(local) != 30 or not local.startswith(b"PK\x03\x04"):
                    return None
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                records[info.header_offset + 30 + name_len + extra_len] = info.file_size
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return records


def _safetensors_records(path: Path) -> dict[int, int] | None:
    """File offset to size of each tensor of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= min(os.fstat(f.fileno()).st_size - 8, 1 << 27):
                return None
            header = json.loads(f.read(n))
        return {
            8 + n + begin: end - begin
            for name, entry in header.items()
            if name != "__metadata__"
            for begin, end in [entry["data_offsets"]]
            if end > begin
        }
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _storage(t: object) -> tuple[int, int] | None:
    """``(address, size)`` of the storage under a dense contiguous CPU tensor with data, else None."""
    if not (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu" and t.is_contiguous()):
        return None
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass(frozen=True)
class Run:
    """A tensor's bytes in the source file, and where they go."""

    start: int
    stop: int
    dtype: torch.dtype
    index: int  # into the checked names, or the output offset for a write


def _mapped_regions(path: Path) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of this process's memory mappings of ``path`` (Linux), adjacent ones merged."""
    st = os.stat(path)
    regions: list[tuple[int, int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or int(fields[4]) != st.st_ino:
                    continue
                device = tuple(int(x, 16) for x in fields[3].split(":"))
                same_device = device == (os.major(st.st_dev), os.minor(st.st_dev))
                if not same_device and fields[5].strip() != os.path.realpath(path):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                regions.append((start, end, int(fields[2], 16)))
    except (OSError, ValueError):
        return []
    regions.sort()
    merged: list[tuple[int, int, int]] = []
    for start, end, offset in regions:
        if merged and merged[-1][1] == start and merged[-1][2] + start - merged[-1][0] == offset:
            merged[-1] = (merged[-1][0], end, merged[-1][2])
        else:
            merged.append((start, end, offset))
    return merged


def _unmodified(spans: list[tuple[int, int]]) -> bool:
    """Whether no page of these ``(address, size)`` spans of a private file mapping was written to.

    A page written to is a private copy: present, and no longer a page of the file
    (``/proc/self/pagemap``). The flags of all spans are read in one go.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    first = min(a for a, _ in spans) // page
    count = -(-max(a + n for a, n in spans) // page) - first
    written = private_pages(first, count)
    if written is None:
        return False
    if not written.any():
        return True
    return not any(written[a // page - first : -(-(a + n) // page) - first].any() for a, n in spans)


class SourceMap:
    """Where the memory-mapped tensors of one file lie in it (see :func:`map_source`).

    Attributes:
        path: The file.
        size: Its size when it was mapped.
    """

    def __init__(self, path: Path, size: int, offsets: dict[tuple[int, int], int]) -> None:
        self.path, self.size = path, size
        self._offsets = offsets  # (address, size) of a storage -> its offset in the file

    def locate(self, t: object) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a tensor's bytes in the file; ``None`` if they are not one run of it."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return 0, 0
        storage = _storage(t)
        begin = None if storage is None else self._offsets.get(storage)
        if begin is None:
            return None
        offset = begin + t.storage_offset() * t.element_size()
        return (int(offset), int(nbytes)) if offset % t.element_size() == 0 else None


def map_source(path: str | os.PathLike[str], tensors: Mapping[str, Any]) -> SourceMap | None:
    """Find where each of ``tensors``, memory-mapped from ``path``, lies in the file.

    Each tensor's storage must lie in this process's memory mapping of the file (Linux:
    ``/proc/self/maps``), exactly on a record of the file (a zip entry of a PyTorch
    file, a tensor of a safetensors file), with none of its pages written to since.

    Returns:
        A :class:`SourceMap`, or ``None`` when a tensor is not one contiguous run of
        the file as it is on disk: a tensor in memory, a strided view, a changed
        page, a legacy or compressed file, or a system without ``/proc``.
    """
    path = Path(path)
    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        return None
    with open(path, "rb") as f:
        magic = f.read(4)
    records = _zip_records(path) if magic == b"PK\x03\x04" else _safetensors_records(path)
    if records is None:
        return None
    regions = _mapped_regions(path)
    offsets: dict[tuple[int, int], int] = {}
    for t in tensors.values():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        if t.numel() == 0:
            continue
        storage = _storage(t)
        if storage is None:
            return None
        if storage in offsets:
            continue
        address, nbytes = storage
        region = next((r for r in regions if r[0] <= address and address + nbytes <= r[1]), None)
        if region is None:
            return None
        offset = region[2] + address - region[0]
        if records.get(offset) != nbytes:
            return None
        offsets[storage] = offset
    if offsets and not _unmodified(list(offsets)):
        return None
    found = SourceMap(path, path.stat().st_size, offsets)
    return found if all(found.locate(t) is not None for t in tensors.values()) else None
