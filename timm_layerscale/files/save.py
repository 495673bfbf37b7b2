"""Writing checkpoint files: atomic and streaming.

Every write goes through :func:`~timm_layerscale.files.atomic.atomic_output`: a
temporary file in the target folder, moved onto the target only when complete.
:func:`save_safetensors` streams
tensors to disk one at a time, so peak memory is about one tensor whatever the file
size, and writes the header and tensors of ``safetensors.torch.save_file``, which is not
used because it builds the whole file in memory first (1.4 GB more for ``M48_448``,
``benchmarks/bench_convert.py``), in a layout that aligns them (``safetensors_plan``). Bad input or a
failed write raises :class:`~timm_layerscale.errors.CheckpointError` with a one-line
message saying what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
from tqdm.utils import CallbackIOWrapper

from .. import progress
from ..errors import CheckpointError
from .atomic import atomic_output, check_output, file_path, no_follow
from .read import TORCH_SUFFIXES, release_pages

__all__ = ["output_format", "save_pth", "save_safetensors", "save_state_dict"]

_WRITE_CHUNK = 16 << 20  # bytes per write call

# safetensors writes tensors in this dtype order (then by name); values are its dtype tags.
_ST_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): tag
    for name, tag in [
        ("uint64", "U64"),
        ("int64", "I64"),
        ("float64", "F64"),
        ("complex64", "C64"),
        ("float32", "F32"),
        ("uint32", "U32"),
        ("int32", "I32"),
        ("bfloat16", "BF16"),
        ("float16", "F16"),
        ("uint16", "U16"),
        ("int16", "I16"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
    ]
    if hasattr(torch, name)
}
_ST_RANK = {dtype: rank for rank, dtype in enumerate(_ST_DTYPES)}


def _check_entry(name: object, t: object) -> None:
    if not isinstance(name, str):
        raise CheckpointError(f"cannot save key {name!r}: names must be strings; rename it")
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(
            f"cannot save {name!r}: it is a {type(t).__name__}, not a tensor; keep only tensors in the state dict"
        )


def safetensors_plan(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> list[tuple[str, torch.dtype, list[int]]]:
    """Names, output dtypes and shapes of ``tensors`` in write order.

    First the tensors whose data is a whole number of 64-byte blocks (every weight matrix of
    these models in fp32), then the rest, each group in safetensors' own order (dtype, then
    name). With the header padded to match (``safetensors_header``), the first group starts
    on 64-byte boundaries of the file, as tensors do in a PyTorch zip and in fresh
    allocations; the format allows no gaps, so the rest are aligned to their item size only.
    The need, measured: a model that computes on the file's own memory (transformers'
    loading, ``load_state_dict(load_file(path), assign=True)``) sums a one-row GEMM (class
    attention and the head, for one image) on a weight at 8 mod 16 bytes in another order;
    transformers' logits for one image differed from timm's by about 5e-7 where the head's
    weight lay there (half of all header lengths), and equal them with this layout.
    """
    plan = []
    for name in tensors:
        t = tensors[name]
        _check_entry(name, t)
        if name == "__metadata__":
            raise CheckpointError("cannot save a tensor named '__metadata__' to safetensors; rename it")
        if t.layout != torch.strided or t.device.type == "meta":
            raise CheckpointError(
                f"cannot save {name!r}: it is a {t.layout} tensor on {t.device}; save dense tensors with data"
            )
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if out not in _ST_RANK:
            raise CheckpointError(f"cannot save {name!r}: safetensors does not support {out}; convert it first")
        plan.append((name, out, list(t.shape)))
    plan.sort(key=lambda item: (item[1].itemsize * math.prod(item[2]) % 64 != 0, _ST_RANK[item[1]], item[0]))
    return plan


def safetensors_header(
    plan: list[tuple[str, torch.dtype, list[int]]], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[int]]:
    """The bytes a safetensors file starts with, and where each planned tensor's data ends.

    Args:
        plan: Names, dtypes and shapes in write order (from ``safetensors_plan``).
        metadata: String to string, stored as ``__metadata__`` with its keys sorted.

    Returns:
        ``(head, ends)``: the 8-byte length, the JSON header and its padding to a
        multiple of 64 bytes in all; and for each entry of ``plan`` the end of its data,
        counted from the end of ``head``.
    """
    if sys.byteorder != "little":
        raise CheckpointError("writing safetensors needs a little-endian machine; convert on x86-64 or ARM")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("safetensors metadata must map strings to strings; convert the values with str()")
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
    ends, offset = [], 0
    for name, out, shape in plan:
        nbytes = out.itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_DTYPES[out], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        ends.append(offset)
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-(len(encoded) + 8) % 64)
    return struct.pack("<Q", len(encoded)) + encoded, ends


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    late_metadata: Callable[[], Mapping[str, str]] | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file, streaming one tensor at a time.

    The header is computed from shapes and dtypes alone; then each tensor is cast
    (if asked), made contiguous and written in 16 MiB pieces, so peak memory is about
    the largest tensor (none at all for contiguous tensors that need no cast). Pages
    of memory-mapped sources are released once written. The header and the tensors' bytes
    equal those of ``safetensors.torch.save_file(tensors, path, metadata)`` (metadata keys
    are written sorted; ``save_file`` orders them arbitrarily); the tensors are laid out
    as ``safetensors_plan`` says. Unlike ``save_file``,
    tensors that share memory or are not contiguous are accepted and written as
    independent copies.

    Args:
        path: Output file.
        tensors: Name to tensor, any device, any shape including 0-d and empty.
        metadata: String to string, stored as the header's ``__metadata__``.
        overwrite: Replace ``path`` if it exists.
        dtype: Cast floating-point tensors to this dtype; others are kept.
        late_metadata: Called once the tensors are written, before the file is put in place;
            its entries replace those of ``metadata`` in the header, which is written again
            where it stands, so they must not change its length (a hash computed meanwhile,
            in place of as many zeros).

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        CheckpointError: A key or value cannot be stored, or writing failed.
        ValueError: ``late_metadata`` changed the header's length.
    """
    target = file_path(path)
    check_output(target, overwrite)
    plan = safetensors_plan(tensors, dtype)
    encoded, offsets = safetensors_header(plan, metadata)
    offset = offsets[-1] if offsets else 0
    with (
        atomic_output(target, overwrite) as tmp,
        open(tmp, "r+b", opener=no_follow) as f,  # not "wb": truncating makes ext4 flush on close
        progress.bar(total=len(encoded) + offset, desc=f"writing {target.name}", unit="B") as bar,
    ):
        f.write(encoded)
        bar.update(len(encoded))
        for name, out, shape in plan:
            source = tensors[name].detach()
            if list(source.shape) != shape:
                raise CheckpointError(f"tensor {name!r} changed shape while saving; save a stable state dict")
            t = source.to(device="cpu", dtype=out).contiguous()
            if t.numel():
                data = t.reshape(-1).view(torch.uint8).numpy().data
                for i in range(0, len(data), _WRITE_CHUNK):
                    bar.update(f.write(data[i : i + _WRITE_CHUNK]))
            del t
            release_pages(source)
        if late_metadata is not None:
            final, _ = safetensors_header(plan, {**(metadata or {}), **late_metadata()})
            if len(final) != len(encoded):
                raise ValueError("late_metadata must not change the length of the safetensors header")
            f.seek(0)
            f.write(final)


class _RecordingWriter:
    """A binary file for ``torch.save`` that keeps the ``OSError`` a write raised.

    ``torch.save`` turns a failed write (``ENOSPC``, ``EIO``) into a ``RuntimeError``
    that does not say why; the recorded error does.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = e
            raise


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns exactly its storage, else a compact copy (so torch.save stores no extra bytes)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def save_pth(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    wrap: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
) -> None:
    """Write a ``{name: tensor}`` dict with ``torch.save``, plain or wrapped.

    Views are stored compactly (not with their whole parent storage). Unlike
    :func:`save_safetensors` this holds every cast tensor in memory at once.

    Args:
        path: Output file.
        state_dict: Name to tensor.
        overwrite: Replace ``path`` if it exists.
        dtype: Cast floating-point tensors to this dtype; others are kept.
        wrap: Turns the (cast) state dict into the object saved, such as
            :func:`~timm_layerscale.conversion.keys.official_checkpoint` for the official
            training code's ``{'model': ...}``; default saves the plain dict.

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        CheckpointError: A value is not a tensor, or writing failed.
    """
    check_output(file_path(path), overwrite)
    plain = {}
    for name, t in state_dict.items():
        _check_entry(name, t)
        t = t.detach()
        plain[name] = _compact(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
    obj = wrap(plain) if wrap is not None else plain
    with atomic_output(path, overwrite) as tmp, open(tmp, "r+b", opener=no_follow) as f:
        sink = _RecordingWriter(f)
        try:
            total = sum(t.numel() * t.element_size() for t in plain.values())
            with progress.bar(total=total, desc=f"writing {Path(path).name}", unit="B") as bar:
                torch.save(obj, cast(IO[bytes], CallbackIOWrapper(bar.update, sink, "write")))
        except RuntimeError:
            if sink.error is not None:  # disk full and the like: report the OS error, not torch's wrapper
                raise sink.error from None
            raise


def save_state_dict(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    fmt: str | None = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    wrap: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
    late_metadata: Callable[[], Mapping[str, str]] | None = None,
) -> None:
    """Write a state dict as safetensors or PyTorch, by ``fmt`` or else the suffix of ``path``.

    Args:
        path: Output file; ``.safetensors`` or one of ``.pth .pt .bin .ckpt`` when
            ``fmt`` is None.
        state_dict: Name to tensor.
        metadata: Stored in safetensors files only; a PyTorch file holds the tensors alone.
        fmt: ``'safetensors'`` or ``'pth'``.
        overwrite: Replace ``path`` if it exists.
        dtype: Cast floating-point tensors to this dtype.
        wrap: PyTorch files only: the container the state dict is saved in (see
            :func:`save_pth`); a safetensors file always holds the flat dict.
        late_metadata: Safetensors files only: metadata known once the tensors are written
            (see :func:`save_safetensors`).

    Raises:
        CheckpointError: Unknown ``fmt`` or suffix, ``wrap`` with safetensors, or
            any error of the writers.
    """
    fmt = output_format(path, fmt)
    if fmt == "safetensors":
        if wrap is not None:
            raise CheckpointError(
                "a safetensors file holds a flat state dict; write a .pth file for a wrapped checkpoint"
            )
        save_safetensors(path, state_dict, metadata, overwrite=overwrite, dtype=dtype, late_metadata=late_metadata)
    else:
        save_pth(path, state_dict, overwrite=overwrite, dtype=dtype, wrap=wrap)


def output_format(path: str | os.PathLike[str], fmt: str | None = None) -> str:
    """The format to write ``path`` in: ``fmt`` if given, else from its suffix (any case).

    Returns:
        ``'safetensors'`` for ``.safetensors``, ``'pth'`` for ``.pth .pt .bin .ckpt``.

    Raises:
        CheckpointError: ``fmt`` is neither, or it is ``None`` and the suffix names no format.
    """
    if fmt is not None:
        if fmt not in ("safetensors", "pth"):
            raise CheckpointError(f"unknown output format {fmt!r}; use 'safetensors' or 'pth'")
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "pth"
    raise CheckpointError(
        f"cannot tell the output format from the name {Path(path).name!r}; "
        "name it .safetensors or .pth, or pass fmt='safetensors'"
    )
