"""Writing state dicts through :func:`~timm_layerscale.files.atomic.atomic_output`."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
from tqdm.utils import CallbackIOWrapper

from .. import progress
from ..errors import CheckpointError, option
from .atomic import atomic_output, output_path
from .read import TORCH_SUFFIXES

__all__ = ["output_format", "save_pth", "save_safetensors"]

_ST_TAGS = """float64:F64 float32:F32 bfloat16:BF16 float16:F16 int64:I64 int32:I32 int16:I16 int8:I8 uint8:U8
    uint16:U16 uint32:U32 uint64:U64 bool:BOOL complex64:C64 float8_e4m3fn:F8_E4M3 float8_e5m2:F8_E5M2"""
_Map = tuple[int, int, int, int, int, str]  # a file mapping: start, end, offset, device, inode, path
_ST_DTYPES = {getattr(torch, n): tag for n, tag in (p.split(":") for p in _ST_TAGS.split()) if hasattr(torch, n)}


def _check_entry(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        raise CheckpointError(f"cannot save {name!r}: a {type(t).__name__}, not a tensor with data; keep only those")


def _header(
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    metadata: Mapping[str, str] | None,
    keep: Collection[str] = (),
) -> tuple[bytes, list[tuple[str, torch.dtype, int]]]:
    """The header (length, JSON, padding to 64 bytes) and the write order: names, output dtypes, sizes."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("safetensors metadata must map strings to strings; convert the values with str()")
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
    plan = []
    for name, t in tensors.items():
        _check_entry(name, t)
        out = dtype if dtype is not None and t.is_floating_point() and name not in keep else t.dtype
        if out not in _ST_DTYPES:
            raise CheckpointError(f"cannot save {name!r}: safetensors does not support {out}; convert it first")
        plan.append((name, out, list(t.shape), out.itemsize * t.numel()))
    # Whole 64-byte blocks first, then the rest by falling item size: with the header padded to 64 bytes every
    # weight matrix starts on a 64-byte boundary, as fresh allocations do, and the rest are item-aligned.
    plan.sort(key=lambda e: (e[3] % 64 != 0, -e[1].itemsize, e[0]))
    offset = 0
    for name, out, shape, nbytes in plan:
        header[name] = {"dtype": _ST_DTYPES[out], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + 8) % 64)
    return struct.pack("<Q", len(encoded)) + encoded, [(name, out, nbytes) for name, out, _, nbytes in plan]


def _file_maps() -> list[_Map]:
    """This process's file mappings as ``/proc/self/maps`` lists them: start and end address, file offset, device,
    inode, path; none where there is no such listing or no ``os.copy_file_range`` (not Linux)."""
    rows, maps = [], []
    if hasattr(os, "copy_file_range"):
        with contextlib.suppress(OSError), open("/proc/self/maps") as f:
            rows = [r.split(maxsplit=5) for r in f]
    for r in (r for r in rows if len(r) == 6 and r[5].startswith("/")):
        (lo, hi), (major, minor) = (int(a, 16) for a in r[0].split("-")), (int(x, 16) for x in r[3].split(":"))
        maps.append((lo, hi, int(r[2], 16), os.makedev(major, minor), int(r[4]), r[5].rstrip("\n")))
    return maps


def _copy_mapped(t: torch.Tensor, f: IO[bytes], maps: list[_Map], fds: dict[str, int]) -> bool:
    """Append ``t``'s bytes to ``f`` by ``os.copy_file_range`` from the file that a mapping holding them shows (a
    mapped source's tensor, whose pages a conversion never writes), copied in the kernel; false, with nothing
    appended, where no file holds them, the file is not the one mapped (device and inode) or its file system refuses."""
    p, start, done = t.data_ptr(), f.tell(), 0
    lo, _, off, dev, ino, path = next((m for m in maps if m[0] <= p and p + t.nbytes <= m[1]), (0, 0, 0, 0, 0, ""))
    if path and path not in fds:
        with contextlib.suppress(OSError):
            fds[path] = os.open(path, os.O_RDONLY)
    with contextlib.suppress(KeyError, OSError):
        if ((st := os.fstat(fds[path])).st_dev, st.st_ino) == (dev, ino):
            f.flush()
            while done < t.nbytes and (
                n := os.copy_file_range(fds[path], f.fileno(), t.nbytes - done, p - lo + off + done, start + done)
            ):
                done += n
    f.seek(start + done if done == t.nbytes else start)  # the offsets given leave the file position where it was
    return done == t.nbytes


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    keep: Collection[str] = (),
    late_metadata: Callable[[], Mapping[str, str]] | None = None,
    check: Callable[[Path], None] | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file one tensor at a time (peak memory: one tensor), floating-point
    ones but those named in ``keep`` cast to ``dtype``, ``metadata`` as the header's ``__metadata__``.

    Every tensor whose size is a multiple of 64 bytes comes first, each on a 64-byte boundary of the file,
    so that a model assigned the file's mapped tensors computes as on fresh ones; the format allows no
    gaps, so the rest are aligned to their item size. ``late_metadata`` is called once the tensors are
    written, for entries that replace as long ones of ``metadata`` (a hash computed meanwhile); ``check`` with
    the complete file's temporary path, before it is put in place (an exception leaves ``path`` as it was).

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        CheckpointError: A key or value cannot be stored, or writing failed.
    """
    output_path(path, overwrite)
    head, plan = _header(tensors, dtype, metadata, keep)
    total = len(head) + sum(n for *_, n in plan)
    with atomic_output(path, overwrite) as tmp:
        maps, fds = _file_maps(), {}  # type: list[_Map], dict[str, int]
        with open(tmp, "r+b") as f, progress.bar(total=total, desc=f"writing {Path(path).name}", unit="B") as bar:
            bar.update(f.write(head))
            try:  # unchanged bytes of a mapped source are copied in the kernel, the rest written from memory
                for name, out, n in plan:
                    t = tensors[name].detach()
                    if not (t.dtype == out and t.is_contiguous() and t.is_cpu and _copy_mapped(t, f, maps, fds)):
                        f.write(t.to(device="cpu", dtype=out).contiguous().reshape(-1).view(torch.uint8).numpy().data)
                    bar.update(n)
            finally:
                for fd in fds.values():
                    os.close(fd)
            if late_metadata is not None:
                final, _ = _header(tensors, dtype, {**(metadata or {}), **late_metadata()}, keep)
                if len(final) != len(head):
                    raise ValueError("late_metadata must not change the length of the safetensors header")
                f.seek(0)
                f.write(final)
        if check is not None:
            check(tmp)


def save_pth(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    keep: Collection[str] = (),
    wrap: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
    check: Callable[[Path], None] | None = None,
) -> None:
    """Write a state dict with ``torch.save``, views stored compactly, cast as :func:`save_safetensors` casts;
    ``wrap`` makes the saved object (the official ``{'model': ...}``). ``check`` and errors as there."""
    output_path(path, overwrite)
    plain = {}
    for name, t in state_dict.items():
        _check_entry(name, t)
        t = t.detach().to(dtype) if dtype is not None and t.is_floating_point() and name not in keep else t.detach()
        whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        plain[name] = t if whole else t.clone(memory_format=torch.contiguous_format)
    total = sum(t.nbytes for t in plain.values())
    with atomic_output(path, overwrite) as tmp:
        with open(tmp, "r+b") as f:  # created empty: opened truncating, ext4 would flush it on close
            try:
                with progress.bar(total=total, desc=f"writing {Path(path).name}", unit="B") as bar:
                    saved = wrap(plain) if wrap else plain
                    torch.save(saved, cast(IO[bytes], CallbackIOWrapper(bar.update, f, "write")))
            except RuntimeError as e:  # torch wraps the OSError of a failed write (disk full)
                if isinstance(e.__context__, OSError):
                    raise e.__context__ from None
                raise
        if check is not None:
            check(tmp)


def output_format(path: str | os.PathLike[str], fmt: str | None = None) -> str:
    """``fmt`` if given, else ``'safetensors'`` or ``'pth'`` by the suffix of ``path``; a
    :class:`~timm_layerscale.errors.CheckpointError` if ``fmt`` is neither or the suffix names no format."""
    suffix = Path(path).suffix.lower()
    found = fmt or ("safetensors" if suffix == ".safetensors" else "pth" if suffix in TORCH_SUFFIXES else None)
    if fmt not in (None, "safetensors", "pth"):
        raise CheckpointError(f"unknown output format {fmt!r}; use 'safetensors' or 'pth'")
    if found is None:
        raise CheckpointError(
            f"cannot tell the output format from the name {Path(path).name!r}; "
            f"name it .safetensors or .pth, or pass {option('fmt', 'safetensors')}"
        )
    return found
