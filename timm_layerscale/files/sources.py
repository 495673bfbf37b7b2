"""Checkpoint sources: a file, a folder, an ``https://`` URL or ``hf-hub:ORG/REPO[@REVISION][/FILE]``, as a
local file; downloads go to torch.hub's or huggingface_hub's cache, failures are one-line ``HubError``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

from ..errors import CheckpointError, HubError
from .hub_errors import hub_errors, one_line

__all__ = ["cached_url_path", "is_remote", "public_source", "published_path", "resolve_source", "source_config"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FOLDER_WEIGHTS = (WEIGHTS_NAME, "pytorch_model.bin")  # in order of preference
URL_PREFIXES = ("https://", "http://")
REMOTE_PREFIXES = (*URL_PREFIXES, "hf-hub:")


def is_remote(source: str | os.PathLike[str]) -> bool:
    """Whether :func:`resolve_source` downloads ``source``: a URL or ``hf-hub:`` id that is no local path."""
    return os.fspath(source).startswith(REMOTE_PREFIXES) and not Path(source).exists()


def resolve_source(source: str | os.PathLike[str]) -> Path:
    """A local file for ``source``: the file itself; a folder's ``model.safetensors`` or ``pytorch_model.bin``;
    a URL or ``hf-hub:`` file (``FILE`` defaults to those names) downloaded once into its cache.

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
                return Path(hf_hub_download(repo_id, name, revision=revision))
            except (RemoteEntryNotFoundError, LocalEntryNotFoundError) as e:
                missing = e
        offline = isinstance(missing, LocalEntryNotFoundError) and constants.is_offline_mode()
        if missing_ok and (offline or isinstance(missing, RemoteEntryNotFoundError)):
            return None
        if not isinstance(missing, RemoteEntryNotFoundError):  # offline or unreachable, nothing cached
            raise missing
    raise HubError(f"{what} has no file {' or '.join(candidates)}; name the file: hf-hub:{repo_id}/FILE")
