"""Reading checkpoints without running their code, the checks made of what was read, and a source read and detected
once (:class:`Source`, :func:`read_source`)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import re
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .. import families
from ..conversion.checkpoint import container_of, state_dict_of
from ..conversion.detect import Detection, Twins, detect
from ..errors import ArchitectureError, CheckpointError, RemapError
from ..families import get_variant
from ..families.loaders import read_config
from .atomic import check_name
from .hub_errors import one_line
from .sources import resolve_source, source_config

__all__ = ["Source", "check_finite", "load_checkpoint", "nonfinite_tensors", "parse_dtype", "read_checkpoint"]
__all__ += ["read_source", "scan_file"]

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CHUNK = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"


def _readable_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    check_name(p)
    if p.is_dir():
        raise CheckpointError(f"{p} is a directory, not a checkpoint; pass the .pth or .safetensors file inside it")
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} not found; check the path")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{p} is empty (0 bytes); download or copy it again")
    return p


def _sniff(p: Path, head: bytes) -> str:
    """``'zip'``, ``'pickle'`` or ``'safetensors'`` from a file's first bytes, else by its suffix."""
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if len(head) > 8 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= p.stat().st_size - 8:
        return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    text = head.decode("utf-8", errors="replace")
    if b"\x00" not in head and sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.95 * len(text):
        if text.startswith("version https://git-lfs"):
            raise CheckpointError(f"{p} is a Git LFS pointer, not the weights; fetch the real file (git lfs pull)")
        first = text.strip().splitlines()[0][:40] if text.strip() else ""
        raise CheckpointError(f"{p} is a text file, not a checkpoint (it starts with {first!r}); download it again")
    if p.suffix.lower() == ".safetensors":
        return "safetensors"  # whose reader names the damage
    raise CheckpointError(f"{p} is neither a PyTorch nor a safetensors file; it may be corrupt, download it again")


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """The top-level dict of a checkpoint (of a safetensors file: its tensors in file order), the format
    told by the first bytes: ``torch.load(weights_only=True)``, memory-mapped unless legacy, or safetensors,
    memory-mapped.

    Raises:
        CheckpointError: The file is missing, empty, truncated, text, of unknown format, holds objects
            other than tensors and containers, or its top level is not a dict.
    """
    p = _readable_file(path)
    with open(p, "rb") as f:
        kind = _sniff(p, f.read(512))
    if kind == "safetensors":
        try:
            with safe_open(str(p), framework="pt") as f:  # the tensors map the file's pages: nothing is read yet
                return {k: f.get_tensor(k) for k in getattr(f, "offset_keys", f.keys)()}
        except SafetensorError as e:
            raise CheckpointError(
                f"{p} is not a valid safetensors file ({one_line(e)}); it may be truncated, download it again"
            ) from None
    try:
        # Training checkpoints carry their argparse.Namespace of options: plain values only.
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(p, map_location="cpu", weights_only=True, mmap=kind == "zip")
    except Exception as e:  # torch raises several unrelated types for bad files
        if "Weights only load failed" not in str(e):
            raise CheckpointError(
                f"{p} could not be read ({one_line(e)}); it may be truncated or corrupt, download it again"
            ) from None
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"{p} contains code or objects that are not tensors{f' ({found[1]})' if found else ''} and was not "
            "loaded; use a checkpoint that holds only tensors, or re-save its state dict where you trust the file"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{p} holds a {type(obj).__name__}, not a dict; expected a state dict or a dict with a 'model' entry"
        )
    return obj


def scan_file(path: str | os.PathLike[str], digest: bool = True) -> str:
    """The SHA-256 of a file as 64 lowercase hex digits (``''`` without ``digest``), read once through a read-only
    mapping; in the same pass each record of a PyTorch zip file is checked against its CRC-32, which ``torch.load``
    skips: a file damaged inside would read as wrong weights. Compressed records, which torch does not write, are
    read through ``zipfile``.

    Raises:
        CheckpointError: A record fails its CRC-32, or the zip directory is damaged.
    """
    sha, pos = hashlib.sha256(), 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
        try:
            with zipfile.ZipFile(f) if view[:4] == _ZIP_MAGIC else contextlib.nullcontext() as z:
                records = []
                for info in z.infolist() if z else []:
                    if z and info.compress_type != zipfile.ZIP_STORED:
                        with z.open(info) as record:  # raises at the end of a record that fails
                            while record.read(_CHUNK):
                                pass
                    elif info.CRC:  # 0: saved without one
                        start = info.header_offset + 30 + sum(struct.unpack_from("<HH", view, info.header_offset + 26))
                        records.append((start, start + info.compress_size, info.CRC, info.filename))
        except (zipfile.BadZipFile, zlib.error) as e:  # a damaged directory, or compressed stream
            raise CheckpointError(f"{path} is corrupt ({e}); download it again") from None
        for start, end, crc, name in [*sorted(records), (len(view),) * 2 + (0, "")] if digest else sorted(records):
            for lo, hi, value in ((pos, start, None), (start, end, 0)):  # the bytes before the record, the record
                for i in range(lo, hi, _CHUNK):
                    if digest:  # the slices are not kept: the mapping closes only once none is left
                        sha.update(view[i : min(i + _CHUNK, hi)])
                    value = None if value is None else zlib.crc32(view[i : min(i + _CHUNK, hi)], value)
            if value != crc:
                raise CheckpointError(f"{path} is corrupt (Bad CRC-32 for file {name!r}); download it again")
            pos = end
    return sha.hexdigest() if digest else ""


def read_checkpoint(
    source: str | os.PathLike[str], ema: bool = False, checksums: bool = True
) -> tuple[Path, dict[str, Any], tuple[str | None, str]]:
    """``(path, state_dict, container)``: the local file of ``source``, its tensors (unwrapped, prefixes stripped,
    lazy where the format allows) and the container they were in
    (:func:`~timm_layerscale.conversion.checkpoint.container_of`), its zip checksums checked unless not ``checksums``.

    Raises:
        CheckpointError: As :func:`load_checkpoint`, or the file holds no weights or values that are not
            tensors; every message names the file.
    """
    path = resolve_source(source)
    checkpoint = load_checkpoint(path)
    if checksums:
        scan_file(path, digest=False)  # before anything is said of the values: damage can read as NaN
    try:
        sd, container = state_dict_of(checkpoint, ema=ema), container_of(checkpoint, ema)
    except RemapError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if all(isinstance(v, Mapping) and not v for v in sd.values()):  # {} or {'state_dict': {}}
        raise CheckpointError(f"{path} holds no weights (an empty state dict); pass a checkpoint with weights")
    if bad := [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is not a tensor; the file is not a state dict")
    return path, sd, container


def nonfinite_tensors(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[str]:
    """The names of the floating-point tensors holding NaN or Inf, in order; with ``dtype``, once cast
    to it (a finite value beyond its range becomes Inf). Extra memory is one chunk of 2**24 elements."""
    bad: list[str] = []
    for name, tensor in state_dict.items():
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        flat = tensor.detach().reshape(-1)
        for i in range(0, flat.numel(), 1 << 24):
            chunk = flat[i : i + (1 << 24)]
            if dtype is not None and chunk.is_floating_point():
                chunk = chunk.to(dtype)
            if chunk.dtype.itemsize == 1:  # no aminmax for 8-bit floats; they widen exactly
                chunk = chunk.to(torch.float32)
            if chunk.is_complex():
                chunk = torch.view_as_real(chunk)
            lo, hi = torch.aminmax(chunk)  # one pass, no mask: a NaN reaches both
            if not bool(lo.isfinite() & hi.isfinite()):
                bad.append(name)
                break
    return bad


def check_finite(state_dict: Mapping[str, torch.Tensor], source: str | os.PathLike[str], advice: str) -> None:
    """Refuse NaN or Inf in one line naming ``source``, the first such tensor, how many there are and ``advice``."""
    if bad := nonfinite_tensors(state_dict):
        raise CheckpointError(f"{source}: {len(bad)} tensor(s) contain NaN or Inf, first {bad[0]!r}; {advice}")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``'fp32'``, ``'fp16'`` or ``'bf16'``."""
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; use fp32, fp16 or bf16")
    return DTYPES[name]


def _background(fn: Callable[[Path], Any], path: Path) -> Future[Any]:
    """``fn(path)`` in a daemon thread (hashlib and zlib release the GIL, so a source is hashed and checked while
    it converts), whose result the Future holds; a process that fails early exits without waiting for it."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(path))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


@dataclass
class Source:
    """A checkpoint read and detected once: the source as given, the local file, its tensors (unwrapped, prefix-free,
    in their own layout, memory-mapped), their :class:`~timm_layerscale.conversion.detect.Detection`, whether they
    were found finite, the scan of the file in a thread (its zip checksums and, unless not asked, its SHA-256),
    whether ``'model_ema'`` was read, the ``config.json`` beside the weights (a folder's, a Hub repository's) and its
    fields, and for a transformers folder its config."""

    given: str
    path: Path
    state_dict: dict[str, torch.Tensor]
    detection: Detection
    finite: bool = False
    intact: Future[str] | None = None
    ema: bool = False
    config_file: Path | None = None
    config_json: dict[str, Any] | None = None
    config: Any = None
    stamp: tuple[int, int, int] = (0, 0, 0)

    def unchanged(self) -> None:
        """A :class:`~timm_layerscale.errors.CheckpointError` where the file's size, modification time or inode
        differ from when it was read (another process wrote into it): the hash would not name the bytes converted."""
        if _stamp(self.path) != self.stamp:
            raise CheckpointError(f"{self.path} changed while it was converted; nothing written")

    def check(self) -> str:
        """Wait for the zip checksums and return the file's SHA-256 (``''`` where none was computed); a
        :class:`~timm_layerscale.errors.CheckpointError` if a checksum fails."""
        return "" if self.intact is None else self.intact.result()

    @property
    def args(self) -> dict[str, Any]:
        """The arguments the loader native to its layout builds its model with (the detection's overrides, and the
        config of a transformers folder)."""
        return {**self.detection.overrides, **({"config": self.config} if self.config is not None else {})}


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def read_source(
    source: str | os.PathLike[str], *, model: str | None = None, ema: bool = False, digest: bool = True
) -> Source:
    """Resolve, read (zip checksums checked meanwhile, with ``digest`` in the same pass the SHA-256) and detect a local
    file or folder, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``; ``model`` overrides detection, ``ema`` takes the
    ``'model_ema'`` weights. The ``config.json`` beside a folder's or repository's weights is parsed here, once: a
    transformers folder's must describe the variant detected, a timm folder's names its architecture.

    Raises:
        LayerScaleError: The source cannot be read or fits no variant, or its config disagrees; the message names
            the file.
    """
    if model:
        get_variant(model)  # a wrong name is the caller's mistake, not the file's
    path, sd, container = read_checkpoint(source, ema, checksums=False)
    stamp = _stamp(path)
    intact = _background(lambda p: scan_file(p, digest), path)
    try:
        file = source_config(source)
        fields = _json_object(file) if file else None
        try:
            found = detect(sd, model, container)
        except Twins:  # told apart by the architecture a timm folder's config.json or a Hub repository names
            if not (named := _named_variant(fields)):
                raise
            found = detect(sd, named, container)
        config = None
        if found.layout.config is not None and fields is not None:
            config = read_config(fields, str(file), found.layout.config, found.variant, found.overrides.get("img_size"))
        return Source(
            os.fspath(source),
            path,
            sd,
            found,
            intact=intact,
            ema=ema,
            config_file=file,
            config_json=fields,
            config=config,
            stamp=stamp,
        )
    except (ArchitectureError, RemapError) as e:
        raise type(e)(f"{path}: {e}") from None


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a one-line :class:`~timm_layerscale.errors.CheckpointError` where it is none."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}); fix or remove it") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} holds no JSON object; fix or remove it")
    return fields


def _named_variant(fields: Mapping[str, Any] | None) -> str | None:
    """The registered variant (or its twin: ``beitv2_base_patch16_224``) that a timm folder's or Hub repository's
    ``config.json`` fields name (``architecture``); ``None`` where they name none."""
    name = str((fields or {}).get("architecture", ""))
    return next((v.name for v in families.VARIANTS if name.split(".")[0] in (v.name, v.reference)), None)
