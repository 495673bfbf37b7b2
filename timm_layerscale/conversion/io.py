"""Reading and writing checkpoint files: the package's only file I/O.

Reading: :func:`load_checkpoint` opens PyTorch files with ``weights_only=True`` and
memory-maps them, and opens safetensors files lazily (:class:`LazySafetensors`).
Writing: :func:`save_safetensors` streams tensors to disk one at a time, so peak
memory is about one tensor whatever the file size, and produces the same bytes as
``safetensors.torch.save_file``. Every write goes to a temporary file in the target
folder and is moved onto the target only when complete, without replacing a file that
another process put there meanwhile unless asked to (:func:`atomic_output`).
Bad input raises :class:`~timm_layerscale.errors.CheckpointError` with a one-line
message saying what is wrong and what to do.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import re
import secrets
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from .. import progress
from ..errors import CheckpointError, OutputExistsError

__all__ = [
    "resolve_source",
    "LazySafetensors",
    "load_checkpoint",
    "sha256_file",
    "file_identity",
    "check_unchanged",
    "check_finite",
    "atomic_output",
    "check_output",
    "save_safetensors",
    "save_pth",
    "save_state_dict",
    "parse_dtype",
]

_TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
_CHUNK = 1 << 20  # bytes per read when hashing
_WRITE_CHUNK = 16 << 20  # bytes per write call
_ZIP_MAGIC = b"PK\x03\x04"

# safetensors writes tensors in this dtype order (then by name); values are its dtype tags.
_ST_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): tag
    for name, tag in [
        ("uint64", "U64"), ("int64", "I64"), ("float64", "F64"), ("complex64", "C64"),
        ("float32", "F32"), ("uint32", "U32"), ("int32", "I32"), ("bfloat16", "BF16"),
        ("float16", "F16"), ("uint16", "U16"), ("int16", "I16"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
        ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
    ]
    if hasattr(torch, name)
}
_ST_RANK = {dtype: rank for rank, dtype in enumerate(_ST_DTYPES)}

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
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


#: Where a checkpoint folder keeps its weights, in order of preference.
FOLDER_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
#: Prefixes of the sources :func:`resolve_source` downloads.
REMOTE_PREFIXES = ("https://", "http://", "hf-hub:")


def resolve_source(source: str | os.PathLike) -> Path:
    """Turn a checkpoint source into a local file.

    Args:
        source: A local file; a folder holding ``model.safetensors`` or
            ``pytorch_model.bin`` (an exported or downloaded Hub folder); an
            ``https://`` URL or ``hf-hub:ORG/REPO[@REVISION][/FILE]``, downloaded once
            into the cache (:func:`~timm_layerscale.hub.download.download_source`).

    Raises:
        CheckpointError: A folder holds none of the weight files.
        HubError: A download failed.
    """
    s = os.fspath(source)
    path = Path(s)
    if s.startswith(REMOTE_PREFIXES) and not path.exists():
        from ..hub.download import download_source

        return download_source(s)
    if path.is_dir():
        for name in FOLDER_WEIGHTS:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"{path} holds neither {' nor '.join(FOLDER_WEIGHTS)}; pass the checkpoint file")
    return path


def _readable_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        raise CheckpointError(f"{p} is a directory, not a checkpoint; pass the .pth or .safetensors file inside it")
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} not found; check the path")
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


def load_checkpoint(path: str | os.PathLike) -> Any:
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
        CheckpointError: The file is missing, a directory, empty, truncated, text, of
            unknown format, holds objects other than tensors and containers, or its
            top level is not a dict.
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
        if suffix in _TORCH_SUFFIXES:
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


def sha256_file(path: str | os.PathLike) -> str:
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


def file_identity(path: str | os.PathLike) -> tuple[int, ...] | None:
    """What changes when a file is rewritten or replaced: device, inode, size, mtime, ctime.

    Returns ``None`` when the file cannot be stat'ed.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_unchanged(path: str | os.PathLike, before: tuple[int, ...] | None) -> None:
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
            f"{path} changed while it was being read (another process wrote it); "
            "convert again once it is complete"
        )


def check_finite(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise if any floating-point tensor holds NaN or Inf.

    Tensors are checked one at a time in chunks of 2**24 elements, so extra memory
    is bounded by one chunk; pages of memory-mapped tensors are released once checked.

    Args:
        state_dict: Name to tensor; non-floating tensors are skipped.

    Raises:
        CheckpointError: Naming the first non-finite tensor and how many there are.
    """
    bad: list[str] = []
    pages = _MappedPages()
    for name, tensor in state_dict.items():
        if not (isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex())):
            continue
        pages.fetch(tensor)
        flat = tensor.detach().reshape(-1)
        if any(not bool(torch.isfinite(flat[i : i + (1 << 24)]).all()) for i in range(0, flat.numel(), 1 << 24)):
            bad.append(name)
        pages.release(tensor)
    if bad:
        raise CheckpointError(
            f"{len(bad)} tensor(s) contain NaN or Inf, first {bad[0]!r}; "
            "check the source checkpoint, or pass allow_nonfinite=True to convert anyway"
        )


def check_output(target: Path, overwrite: bool) -> None:
    if target.is_dir():
        raise CheckpointError(
            f"output {target} is a directory; pass a file path such as {target / 'model.safetensors'}"
        )
    if target.exists() and not overwrite:
        raise OutputExistsError(f"output {target} exists; pass overwrite=True to replace it")
    parent = target.parent
    if not parent.is_dir():
        raise CheckpointError(f"output folder {parent} does not exist; create it or choose another output path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"output folder {parent} is not writable; choose another output path")


# link(2) errors meaning "this filesystem has no hard links", not "the target exists".
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` onto ``target``; without ``overwrite``, never replace a file.

    ``os.link`` fails with ``EEXIST`` when ``target`` exists, atomically, so of two
    writers racing for one name exactly one wins and the other gets
    :class:`OutputExistsError`; the file is always one writer's whole output. Where
    the filesystem has no hard links, the existence check and ``os.replace`` are two
    steps, which leaves a short window for a writer in another process.
    """
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputExistsError(f"output {target} exists; pass --overwrite to replace it") from None
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
        check_output(target, overwrite)
        os.replace(tmp, target)
        return
    with contextlib.suppress(OSError):  # the output is complete; only a failing unlink keeps this name
        tmp.unlink()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it onto ``path`` on success.

    The temporary file (``.{name}.tmp-XXXXXXXX`` in the target folder) is created
    empty; the caller writes it by name. On any exception, including
    ``KeyboardInterrupt``, it is deleted and ``path`` is left as it was. Without
    ``overwrite`` the last step is a hard link, which fails if ``path`` exists by
    then (another process wrote it first), so an existing file is never replaced;
    with ``overwrite`` it is a rename. Either way ``path`` holds one whole file,
    never a mix. Protects against failure of this process, not against power loss
    (no ``fsync``).

    Args:
        path: The final file.
        overwrite: Replace ``path`` if it exists.

    Raises:
        OutputExistsError: ``path`` exists (checked before writing, and atomically
            when the finished file is put in place) and ``overwrite`` is false.
        CheckpointError: ``path`` is a directory, its folder is missing or not
            writable, or writing failed (for example, disk full).
    """
    target = Path(path)
    check_output(target, overwrite)
    while True:
        tmp = target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise CheckpointError(
                f"cannot create a file in {target.parent} ({e.strerror}); choose another output path"
            ) from None
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


class _MappedPages:
    """Prefetch and release the pages of tensors memory-mapped from a file (Linux only).

    Every page of a memory-mapped source that has been read counts in the process's
    resident set until it is unmapped. :meth:`release` unmaps a tensor's pages
    (``MADV_DONTNEED``; they stay in the page cache) only when all of them still
    hold file data, so in-place changes to a tensor are never lost. :meth:`fetch`
    (``MADV_POPULATE_READ``, Linux 5.14+) maps a tensor's pages in one call rather
    than one fault at a time. Elsewhere both do nothing.
    """

    _DONTNEED, _POPULATE_READ = 4, 22

    def __init__(self) -> None:
        self._madvise = None
        if not (sys.platform.startswith("linux") and os.access("/proc/self/pagemap", os.R_OK)):
            return
        try:
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _span(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        if self._madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            return None
        begin = tensor.data_ptr()
        lo = begin - begin % self._page
        return lo, begin + tensor.nbytes - lo

    def fetch(self, tensor: torch.Tensor) -> None:
        if span := self._span(tensor):
            self._madvise(*span, self._POPULATE_READ)

    def release(self, tensor: torch.Tensor) -> None:
        if not (span := self._span(tensor)):
            return
        lo, length = span
        count = -(-length // self._page)
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
                pagemap.seek(lo // self._page * 8)
                flags = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
        except OSError:
            return
        present, file_page = (flags >> 63) & 1, (flags >> 61) & 1
        if len(flags) == count and not np.any(present & (file_page ^ 1)):
            self._madvise(lo, length, self._DONTNEED)


def _check_entry(name: object, t: object) -> None:
    if not isinstance(name, str):
        raise CheckpointError(f"cannot save key {name!r}: names must be strings; rename it")
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(
            f"cannot save {name!r}: it is a {type(t).__name__}, not a tensor; keep only tensors in the state dict"
        )


def _plan(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> list[tuple[str, torch.dtype, list[int]]]:
    """Names, output dtypes and shapes of ``tensors`` in safetensors' write order."""
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
    plan.sort(key=lambda item: (_ST_RANK[item[1]], item[0]))
    return plan


def save_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file, streaming one tensor at a time.

    The header is computed from shapes and dtypes alone; then each tensor is cast
    (if asked), made contiguous and written in 16 MiB pieces, so peak memory is about
    the largest tensor (none at all for contiguous tensors that need no cast). Pages
    of memory-mapped sources are released once written. The bytes equal those of
    ``safetensors.torch.save_file(tensors, path, metadata)`` (metadata keys are
    written sorted; ``save_file`` orders them arbitrarily). Unlike ``save_file``,
    tensors that share memory or are not contiguous are accepted and written as
    independent copies.

    Args:
        path: Output file.
        tensors: Name to tensor, any device, any shape including 0-d and empty.
        metadata: String to string, stored as the header's ``__metadata__``.
        overwrite: Replace ``path`` if it exists.
        dtype: Cast floating-point tensors to this dtype; others are kept.

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        CheckpointError: A key or value cannot be stored, or writing failed.
    """
    target = Path(path)
    check_output(target, overwrite)
    if sys.byteorder != "little":
        raise CheckpointError("writing safetensors needs a little-endian machine; convert on x86-64 or ARM")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("safetensors metadata must map strings to strings; convert the values with str()")
    plan = _plan(tensors, dtype)
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, out, shape in plan:
        nbytes = out.itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_DTYPES[out], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    pages = _MappedPages()
    with (
        atomic_output(target, overwrite) as tmp,
        open(tmp, "r+b") as f,  # not "wb": truncating makes ext4 flush on close
        progress.bar(total=8 + len(encoded) + offset, desc=f"writing {target.name}", unit="B", unit_scale=True) as bar,
    ):
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        bar.update(8 + len(encoded))
        for name, out, shape in plan:
            source = tensors[name].detach()
            if list(source.shape) != shape:
                raise CheckpointError(f"tensor {name!r} changed shape while saving; save a stable state dict")
            pages.fetch(source)
            t = source.to(device="cpu", dtype=out).contiguous()
            if t.numel():
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(data), _WRITE_CHUNK):
                    bar.update(f.write(data[i : i + _WRITE_CHUNK]))
            del t
            pages.release(source)


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
    path: str | os.PathLike,
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
    check_output(Path(path), overwrite)
    plain = {}
    for name, t in state_dict.items():
        _check_entry(name, t)
        t = t.detach()
        plain[name] = _compact(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
    obj = wrap(plain) if wrap is not None else plain
    with atomic_output(path, overwrite) as tmp, open(tmp, "r+b") as f:
        sink = _RecordingWriter(f)
        try:
            if not progress.enabled():
                torch.save(obj, sink)
            else:
                total = sum(t.numel() * t.element_size() for t in plain.values())
                with progress.bar(total=total, desc=f"writing {Path(path).name}", unit="B", unit_scale=True) as bar:
                    torch.save(obj, progress.ByteCounter(sink, bar))
        except RuntimeError:
            if sink.error is not None:  # disk full and the like: report the OS error, not torch's wrapper
                raise sink.error from None
            raise


def save_state_dict(
    path: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    fmt: str | None = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    wrap: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
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

    Raises:
        CheckpointError: Unknown ``fmt`` or suffix, ``wrap`` with safetensors, or
            any error of the writers.
    """
    if fmt is None:
        suffix = Path(path).suffix.lower()
        if suffix == ".safetensors":
            fmt = "safetensors"
        elif suffix in _TORCH_SUFFIXES:
            fmt = "pth"
        else:
            raise CheckpointError(
                f"cannot tell the output format from {path}; name it .safetensors or .pth, or pass format='pth'"
            )
    if fmt == "safetensors":
        if wrap is not None:
            raise CheckpointError("a safetensors file holds a flat state dict; write a .pth file for a wrapped checkpoint")
        save_safetensors(path, state_dict, metadata, overwrite=overwrite, dtype=dtype)
    elif fmt == "pth":
        save_pth(path, state_dict, overwrite=overwrite, dtype=dtype, wrap=wrap)
    else:
        raise CheckpointError(f"unknown output format {fmt!r}; use 'safetensors' or 'pth'")


def parse_dtype(name: str) -> torch.dtype:
    """Return the torch dtype for ``'fp32'``, ``'fp16'`` or ``'bf16'`` (or ``'float32'``, ``'half'``, ...)."""
    try:
        return _DTYPE_NAMES[name.strip().lower()]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; use fp32, fp16 or bf16") from None
