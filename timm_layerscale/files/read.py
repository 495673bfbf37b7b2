"""A source read and detected once (:class:`Source`, :func:`read_source`): a file, a folder, an ``https://`` URL or
``hf-hub:ORG/REPO[@REVISION][/FILE]`` as a local file (downloads go to torch.hub's or huggingface_hub's cache, their
failures are one-line :class:`~timm_layerscale.errors.HubError`), its tensors read without running its code, and the
checks made of what was read."""

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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

import torch
from safetensors import SafetensorError, safe_open

from .. import families
from ..conversion.checkpoint import container_of, state_dict_of
from ..conversion.detect import Detection, Twins, detect
from ..errors import ArchitectureError, CheckpointError, HubError, LayerScaleError, RemapError, one_line
from ..families import get_variant
from ..families.loaders import read_config
from .atomic import check_name

__all__ = ["Source", "check_finite", "load_checkpoint", "nonfinite_tensors", "parse_dtype", "read_checkpoint"]
__all__ += ["read_source", "read_state_dict", "scan_file"]
__all__ += [
    "cached_url_path",
    "hub_errors",
    "is_remote",
    "public_source",
    "published_path",
    "resolve_source",
    "source_config",
]

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CHUNK = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"
_INDEX_SUFFIX = ".safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # a sharded checkpoint's, beside its shards
CONFIG_NAME = "config.json"
FOLDER_WEIGHTS = (WEIGHTS_NAME, INDEX_NAME, "pytorch_model.bin")  # in order of preference
URL_PREFIXES = ("https://", "http://")
REMOTE_PREFIXES = (*URL_PREFIXES, "hf-hub:")


def is_remote(source: str | os.PathLike[str]) -> bool:
    """Whether :func:`resolve_source` downloads ``source``: a URL or ``hf-hub:`` id that is no local path."""
    return os.fspath(source).startswith(REMOTE_PREFIXES) and not Path(source).exists()


def resolve_source(source: str | os.PathLike[str]) -> Path:
    """A local file for ``source``: the file itself; a folder's ``model.safetensors``, the index of its shards
    (``model.safetensors.index.json``) or ``pytorch_model.bin``; a URL or ``hf-hub:`` file (``FILE`` defaults to those
    names; an index's shards come with it) downloaded once into its cache.

    Raises:
        CheckpointError: A folder holds none of the weight files.
        HubError: A download failed.
    """
    if is_remote(source):
        source = os.fspath(source)
        if source.startswith(URL_PREFIXES):
            return _download_url(source)
        return _download_from_hub(*_parse_hub_spec(source))
    path = Path(source)
    if path.is_dir():
        for name in FOLDER_WEIGHTS:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"{path} holds neither {' nor '.join(FOLDER_WEIGHTS)}; pass the checkpoint file")
    return path


def source_config(source: str | os.PathLike[str]) -> Path | None:
    """The ``config.json`` beside a folder's or an ``hf-hub:ORG/REPO``'s weights; ``None`` for a file or URL, a
    repository without one, and offline where none is cached.

    Raises:
        HubError: The Hub refused the request (token, gated repository, server error) or is unreachable.
    """
    if not is_remote(source):
        path = Path(source) / CONFIG_NAME
        return path if path.is_file() else None
    if os.fspath(source).startswith(URL_PREFIXES):
        return None
    repo_id, revision, filename = _parse_hub_spec(os.fspath(source))
    if filename not in (None, *FOLDER_WEIGHTS):
        return None
    return _download_from_hub(repo_id, revision, CONFIG_NAME, missing_ok=True)


def public_source(source: str | os.PathLike[str]) -> str:
    """``source`` as a card, message or log may show it: a URL without user name, password, query and
    fragment, which can hold credentials."""
    source = os.fspath(source)
    if not source.startswith(URL_PREFIXES):
        return source
    url = urlsplit(source)
    return urlunsplit((url.scheme, url.netloc.rpartition("@")[2], url.path, "", ""))


def published_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a published card shows it: remote sources by :func:`public_source`, a local path by its name."""
    path = os.fspath(path)
    return public_source(path) if path.startswith(REMOTE_PREFIXES) else os.path.basename(os.path.normpath(path)) or path


def _parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    parts = spec[len("hf-hub:") :].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise HubError(f"{spec!r} is not a Hub source; write hf-hub:ORG/REPO or hf-hub:ORG/REPO/FILE")
    repo_id, _, revision = "/".join(parts[:2]).partition("@")
    file = parts[2:]
    if revision == "refs" and len(file) >= 2:  # a pull request's refs/pr/N
        revision, file = "/".join(["refs", *file[:2]]), file[2:]
    return repo_id, revision or None, "/".join(file) or None


def cached_url_path(url: str) -> Path:
    """Where a URL's download is kept: ``checkpoints/<hash>/<name>`` in torch.hub's folder, ``hash`` the first 16 hex
    digits of the SHA-256 of the URL without its user name and password, so that two URLs of one file name (every
    Hub ``resolve/.../model.safetensors``) never share a file."""
    import hashlib

    import torch.hub

    if not (name := os.path.basename(urlparse(url).path)):
        raise HubError(f"cannot tell a file name from {public_source(url)}; give the URL of the checkpoint file")
    parts = urlsplit(url)
    key = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, parts.fragment))
    return Path(torch.hub.get_dir()) / "checkpoints" / hashlib.sha256(key.encode()).hexdigest()[:16] / name


def _download_url(url: str) -> Path:
    import urllib.error

    import torch.hub
    from huggingface_hub import constants

    from .. import progress

    target = cached_url_path(url)
    if target.is_file() and target.stat().st_size > 0:  # torch.hub itself always downloads again
        return target
    shown = public_source(url)
    if constants.is_offline_mode():
        raise HubError(f"HF_HUB_OFFLINE is set, so downloading {shown} is not possible; unset it and retry")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(url, str(target), progress=progress.enabled())
    except (OSError, ValueError) as e:  # HTTPError and URLError are OSErrors
        http = isinstance(e, urllib.error.HTTPError)
        advice = "check the URL" if getattr(e, "code", None) == 404 else "check the network and retry"
        raise HubError(
            f"could not download {shown}: {one_line(e if http else getattr(e, 'reason', e))}; {advice}"
        ) from e
    return target


def _download_from_hub(repo_id: str, revision: str | None, filename: str | None, missing_ok: bool = False) -> Any:
    """The cached path of the first of ``filename`` (default :data:`FOLDER_WEIGHTS`) the repository has; with
    ``missing_ok``, ``None`` where the Hub says it has none, or offline where none is cached."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    what = f"hf-hub:{repo_id}" + (f"@{revision}" if revision else "")
    candidates = [filename] if filename else list(FOLDER_WEIGHTS)
    with hub_errors(f"downloading {what}", repo_id, revision=revision, download=True):
        for name in candidates:
            try:
                path = Path(hf_hub_download(repo_id, name, revision=revision))
                for shard in dict.fromkeys(_weight_map(path).values()) if name.endswith(_INDEX_SUFFIX) else ():
                    hf_hub_download(repo_id, shard, revision=revision)
                return path
            except (RemoteEntryNotFoundError, LocalEntryNotFoundError) as e:
                missing = e
        offline = isinstance(missing, LocalEntryNotFoundError) and constants.is_offline_mode()
        if missing_ok and (offline or isinstance(missing, RemoteEntryNotFoundError)):
            return None
        if not isinstance(missing, RemoteEntryNotFoundError):  # offline or unreachable, nothing cached
            raise missing
    raise HubError(f"{what} has no file {' or '.join(candidates)}; name the file: hf-hub:{repo_id}/FILE")


def _http_message(status: int | None, action: str, repo_id: str, revision: str | None, download: bool) -> str:
    if download and status in (401, 403, 404):  # reading: missing or private
        return f"{repo_id} was not found or is not accessible ({status}) while {action}; check the repo id, or run 'hf auth login' if it is private"
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized) while {action}; run 'hf auth login' (or set HF_TOKEN) with a valid token that has write access"
    if status in (403, 404):
        what = f"{repo_id} (revision {revision!r})" if revision else repo_id
        return f"{what} was not found, or the token may not write to it ({status}), while {action}; check the repo id, or use a token with write access ('hf auth login')"
    advice = "retry in a few minutes" if status == 429 or (status or 0) >= 500 else "check the network and retry"
    return f"the Hub answered {status} while {action}; {advice}"


def _message(e: BaseException, action: str, repo_id: str, revision: str | None, download: bool) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx  # its HTTP client: httpx2 from 2.0, httpx in 1.x

    if isinstance(e, LocalEntryNotFoundError) and isinstance(e.__cause__, HfHubHTTPError):  # online, refused
        e = e.__cause__
    if isinstance(e, OfflineModeIsEnabled) or (isinstance(e, LocalEntryNotFoundError) and constants.is_offline_mode()):
        return f"HF_HUB_OFFLINE is set, so {action} is not possible (nothing cached); unset HF_HUB_OFFLINE and retry"
    if isinstance(e, GatedRepoError):
        return f"{repo_id} is gated; accept its terms on the Hub, run 'hf auth login', then retry"
    if isinstance(e, RevisionNotFoundError) and revision is not None:
        return f"{repo_id} has no revision {revision!r} while {action}; check the revision"
    if isinstance(e, HfHubHTTPError):
        response = getattr(e, "response", None)
        return _http_message(getattr(response, "status_code", None), action, repo_id, revision, download)
    if isinstance(e, LocalTokenNotFoundError):
        return "no Hugging Face token found; run 'hf auth login' or set HF_TOKEN"
    if isinstance(e, (LocalEntryNotFoundError, ConnectionError, TimeoutError, httpx.TransportError)):
        return f"could not reach the Hub at {constants.ENDPOINT} while {action} ({one_line(e, 100)}); check the network and retry"
    if isinstance(e, ValueError):
        return f"{action} failed: {one_line(e)}; fix the folder or options and retry"
    return None


@contextlib.contextmanager
def hub_errors(action: str, repo_id: str, *, revision: str | None = None, download: bool = False) -> Iterator[None]:
    """Raise what huggingface_hub raises in the block as a one-line HubError about ``action`` (to follow
    "while": ``"uploading to ORG/NAME"``) on ``repo_id`` at ``revision``; with ``download`` the block reads
    (401/403/404 mean missing or private) rather than writes (the token)."""
    try:
        yield
    except LayerScaleError:
        raise
    except Exception as e:
        message = _message(e, action, repo_id, revision, download)
        if message is None:
            raise
        raise HubError(message) from e


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
    """``'zip'``, ``'pickle'`` or ``'safetensors'`` from a file's first bytes, else by its suffix; ``'index'``: a
    sharded safetensors checkpoint's index, by its name."""
    if p.name.endswith(_INDEX_SUFFIX):
        return "index"
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
    memory-mapped; of a sharded safetensors checkpoint's index, the tensors of its shards (each mapped, shard by
    shard in the index's order), exactly those the index lists.

    Raises:
        CheckpointError: The file is missing, empty, truncated, text, of unknown format, holds objects
            other than tensors and containers, or its top level is not a dict; a shard is missing, lacks a tensor
            the index puts in it or holds one it does not.
    """
    p = _readable_file(path)
    with open(p, "rb") as f:
        kind = _sniff(p, f.read(512))
    if kind == "index":
        tensors: dict[str, Any] = {}
        listed = _weight_map(p)
        for shard in dict.fromkeys(listed.values()):
            found = load_checkpoint(p.parent / shard)
            stray = [k for k in found if listed.get(k) != shard]
            lost = [k for k, name in listed.items() if name == shard and k not in found]
            if stray or lost:
                what = (
                    f"holds {stray[0]!r}, which {p.name} puts elsewhere"
                    if stray
                    else f"lacks {lost[0]!r}, which {p.name} puts there"
                )
                raise CheckpointError(
                    f"{p.parent / shard} {what}; the shards do not match their index, download the checkpoint again"
                )
            tensors.update(found)
        return tensors
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


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint's ``index``: each tensor's shard, a file beside it; a one-line
    :class:`~timm_layerscale.errors.CheckpointError` where it maps none or names a shard outside its folder."""
    listed = _json_object(index).get("weight_map")
    if not isinstance(listed, dict) or not listed:
        raise CheckpointError(f"{index} has no weight_map of tensors to shards; download the checkpoint again")
    if bad := [s for s in listed.values() if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]:
        raise CheckpointError(f"{index} names {bad[0]!r} as a shard, not a file beside it; check where it came from")
    return listed


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


def read_state_dict(
    checkpoint: str | os.PathLike[str] | Mapping[str, Any], ema: bool = False
) -> tuple[dict[str, Any], tuple[str | None, str]]:
    """``(state_dict, container)`` of a local checkpoint file (:func:`load_checkpoint`) or of a checkpoint in memory:
    its tensors, unwrapped and prefixes stripped (lazy where the format allows), and the container they were in
    (:func:`~timm_layerscale.conversion.checkpoint.container_of`).

    Raises:
        CheckpointError: As :func:`load_checkpoint`, or it holds no weights or values that are not tensors; every
            message names the file.
    """
    where = "the checkpoint" if isinstance(checkpoint, Mapping) else os.fspath(checkpoint)
    obj = checkpoint if isinstance(checkpoint, Mapping) else load_checkpoint(checkpoint)
    try:
        sd, container = state_dict_of(obj, ema=ema), container_of(obj, ema)
    except RemapError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if all(isinstance(v, Mapping) and not v for v in sd.values()):  # {} or {'state_dict': {}}
        raise CheckpointError(f"{where} holds no weights (an empty state dict); pass a checkpoint with weights")
    if bad := [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
        raise CheckpointError(f"{where}: entry {bad[0]!r} is not a tensor; the file is not a state dict")
    return sd, container


def read_checkpoint(
    source: str | os.PathLike[str], ema: bool = False, checksums: bool = True
) -> tuple[Path, dict[str, Any], tuple[str | None, str]]:
    """``(path, state_dict, container)``: the local file of ``source`` (:func:`resolve_source`) and what
    :func:`read_state_dict` reads of it, its zip checksums checked unless not ``checksums``.

    Raises:
        CheckpointError: As :func:`read_state_dict`, or a zip record fails its checksum.
    """
    path = resolve_source(source)
    sd, container = read_state_dict(path, ema)
    if checksums:
        scan_file(path, digest=False)  # before anything is said of the values: damage can read as NaN
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

    @property
    def legacy(self) -> bool:
        """Whether the file is a legacy (pre-zip) ``.pth``, whose tensors ``torch.load`` reads whole: it cannot map
        one (a state dict given in memory: ``False``)."""
        if not self.path.is_file():
            return False
        with open(self.path, "rb") as f:
            return _sniff(self.path, f.read(512)) == "pickle"

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
