"""Checkpoint sources: a file, a folder, an ``https://`` URL or an ``hf-hub:`` id, made a local file.

:func:`resolve_source` turns any of them into a local file; :func:`download_source` turns an ``https://`` URL or ``hf-hub:ORG/REPO[@REVISION][/FILE]``
into a local file in a cache (:func:`cached_url_path` says where a URL goes);
:func:`source_config` finds the ``config.json`` a folder or a Hub repository comes with.
:func:`check_online` fails at once, with one line, when the network is off, before
any retry loop starts; :func:`hub_endpoint` is the Hub address every request uses.

The only requests sent from here are in ``_download_url`` and
``_download_from_hub``. Failures become one-line
:class:`~timm_layerscale.errors.HubError` messages; those of huggingface_hub through
:func:`~timm_layerscale.files.hub_errors.hub_errors`.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse, urlsplit, urlunsplit

from ..errors import CheckpointError, HubError
from ..families import CAIT_RELEASE_URL
from .hub_errors import hub_errors, one_line

__all__ = [
    "download_source",
    "cached_url_path",
    "check_online",
    "hub_endpoint",
    "is_remote",
    "public_source",
    "published_path",
    "resolve_source",
    "source_config",
]

#: The weights file of an exported folder.
WEIGHTS_NAME = "model.safetensors"
#: The configuration file of an exported folder or Hub model repository (timm's and transformers').
CONFIG_NAME = "config.json"
#: Where a checkpoint folder keeps its weights, in order of preference.
FOLDER_WEIGHTS = (WEIGHTS_NAME, "pytorch_model.bin")
#: Prefixes of the URL sources.
URL_PREFIXES = ("https://", "http://")
#: Prefixes of the sources :func:`resolve_source` downloads.
REMOTE_PREFIXES = (*URL_PREFIXES, "hf-hub:")


def resolve_source(source: str | os.PathLike[str]) -> Path:
    """Turn a checkpoint source into a local file.

    Args:
        source: A local file; a folder holding ``model.safetensors`` or
            ``pytorch_model.bin`` (an exported or downloaded Hub folder); an
            ``https://`` URL or ``hf-hub:ORG/REPO[@REVISION][/FILE]``, downloaded once
            into the cache (:func:`download_source`).

    Raises:
        CheckpointError: A folder holds none of the weight files.
        HubError: A download failed.
    """
    if is_remote(source):
        return download_source(os.fspath(source))
    path = Path(source)
    if path.is_dir():
        for name in FOLDER_WEIGHTS:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"{path} holds neither {' nor '.join(FOLDER_WEIGHTS)}; pass the checkpoint file")
    return path


def source_config(source: str | os.PathLike[str]) -> Path | None:
    """The ``config.json`` that comes with a source: a local folder's, or that of the Hub
    repository whose weights ``hf-hub:ORG/REPO[@REVISION]`` names (downloaded into the cache);
    ``None`` for a file, a URL, another file of a repository, or where there is none or it
    cannot be fetched (the weights' download then says why).
    """
    if not is_remote(source):  # a folder, as resolve_source tells sources apart
        path = Path(source) / CONFIG_NAME
        return path if path.is_file() else None
    if os.fspath(source).startswith(URL_PREFIXES):  # a URL names one file
        return None
    repo_id, revision, filename = _parse_hub_spec(os.fspath(source))
    if filename not in (None, *FOLDER_WEIGHTS):
        return None
    try:
        return _download_from_hub(repo_id, revision, CONFIG_NAME)
    except HubError:
        return None


def public_source(source: str | os.PathLike[str]) -> str:
    """``source`` as a model card, a message or a log may show it: a URL without its user name,
    password, query and fragment, which can hold credentials (a presigned URL's signature, a
    token); others unchanged."""
    source = os.fspath(source)
    if not source.startswith(URL_PREFIXES):
        return source
    url = urlsplit(source)
    return urlunsplit((url.scheme, url.netloc.rpartition("@")[2], url.path, "", ""))


def published_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a published model card shows it: a URL or ``hf-hub:`` id by
    :func:`public_source`, a local path by its name alone (as the card's source line and the
    weights' metadata name the source), so that no local folder goes to the Hub."""
    path = os.fspath(path)
    if path.startswith(REMOTE_PREFIXES):
        return public_source(path)
    return os.path.basename(os.path.normpath(path)) or path


def is_remote(source: str | os.PathLike[str]) -> bool:
    """Whether :func:`resolve_source` downloads ``source``: a URL or ``hf-hub:`` id that is no local path."""
    return os.fspath(source).startswith(REMOTE_PREFIXES) and not Path(source).exists()


def hub_endpoint() -> str:
    """The Hub address: ``HF_ENDPOINT`` as set now, else huggingface_hub's default."""
    env = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    if env:
        return env
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def download_source(source: str) -> Path:
    """Download a remote checkpoint source (once) and return the local file.

    Args:
        source: An ``https://`` (or ``http://``) URL, downloaded once into torch.hub's
            cache (:func:`cached_url_path`) and reused afterwards;
            or ``hf-hub:ORG/REPO[@REVISION][/FILE]``, fetched with huggingface_hub
            into its cache (``FILE`` defaults to ``model.safetensors``, else
            ``pytorch_model.bin``).

    Raises:
        HubError: A download failed; the message says whether to check the
            address, log in, or retry.
    """
    if source.startswith(URL_PREFIXES):
        return _download_url(source)
    repo_id, revision, filename = _parse_hub_spec(source)
    return _download_from_hub(repo_id, revision, filename)


def _parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    rest = spec[len("hf-hub:") :].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise HubError(f"{spec!r} is not a Hub source; write hf-hub:ORG/REPO or hf-hub:ORG/REPO/FILE")
    repo_id, _, revision = "/".join(parts[:2]).partition("@")
    file = parts[2:]
    if revision == "refs" and len(file) >= 2:  # a pull request's refs/pr/N (or refs/convert/NAME)
        revision, file = "/".join(["refs", *file[:2]]), file[2:]
    return repo_id, revision or None, "/".join(file) or None


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (read now, as huggingface_hub reads it)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _resolves(url: str) -> bool:
    """Whether the host of ``url`` has an address; ``False`` when name resolution fails (no network)."""
    host = urlparse(url).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    except (OSError, UnicodeError):
        return True  # let the download itself report it
    return True


def check_online(url: str, action: str) -> None:
    """Fail at once, with one line, when ``url`` cannot be reached for ``action``.

    Raised when ``HF_HUB_OFFLINE`` is set or the host's name does not resolve, so
    that an offline machine gets its answer before any retry loop starts.

    Raises:
        HubError: Offline mode is on, or the host's name does not resolve.
    """
    if _offline():
        raise HubError(f"HF_HUB_OFFLINE is set, so {action} is not possible; unset HF_HUB_OFFLINE and retry")
    if not _resolves(url):
        host = urlparse(url).hostname
        raise HubError(f"cannot resolve {host} (no network?) while {action}; check the network and retry")


def cached_url_path(url: str) -> Path:
    """Where :func:`download_source` keeps the download of ``url``: torch.hub's checkpoint cache.

    The official release files keep torch.hub's own path, ``checkpoints/<name>`` (their names
    are unique there, and a file torch.hub fetched is reused). Any other URL's file goes in a
    folder named by a hash of the whole URL, so that two URLs ending in the same name
    (``.../v1/model.pth`` and ``.../v2/model.pth``) never share a download.
    """
    import torch.hub

    name = os.path.basename(urlparse(url).path)
    if not name:
        raise HubError(f"cannot tell a file name from {url}; give the URL of the checkpoint file")
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    if url.startswith(CAIT_RELEASE_URL):
        return folder / name
    return folder / hashlib.sha256(url.encode()).hexdigest()[:16] / name


def _download_url(url: str) -> Path:
    """Download ``url`` into torch.hub's checkpoint cache (reused when already there)."""
    import http.client
    import urllib.error

    import torch.hub

    from .. import progress

    target = cached_url_path(url)
    if target.is_file() and target.stat().st_size > 0:
        return target
    shown = public_source(url)  # messages end up in logs: no credentials
    check_online(url, f"downloading {shown}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(url, str(target), progress=progress.enabled())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise HubError(f"could not download {shown}: not found (404); check the URL") from e
        raise HubError(f"could not download {shown}: {one_line(e)}; check the network and retry") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e  # URLError wraps the socket's error
        raise HubError(f"could not download {shown}: {one_line(reason)}; check the network and retry") from e
    return target


def _download_from_hub(repo_id: str, revision: str | None, filename: str | None) -> Path:
    """Fetch one file of a Hub repository into huggingface_hub's cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    what = f"hf-hub:{repo_id}" + (f"@{revision}" if revision else "")
    candidates = [filename] if filename else list(FOLDER_WEIGHTS)
    endpoint = hub_endpoint()
    with hub_errors(f"downloading {what}", repo_id, endpoint=endpoint, revision=revision, download=True):
        if _offline() or not _resolves(endpoint):
            # No network: serve the cache at once instead of retrying for half a minute.
            for name in candidates:
                try:
                    return Path(
                        hf_hub_download(repo_id, name, revision=revision, endpoint=endpoint, local_files_only=True)
                    )
                except LocalEntryNotFoundError:
                    continue
            check_online(endpoint, f"downloading {what} (not in the local cache)")
        for name in candidates:
            try:
                return Path(hf_hub_download(repo_id, name, revision=revision, endpoint=endpoint))
            except RemoteEntryNotFoundError:
                continue
    raise HubError(f"{what} has no file {' or '.join(candidates)}; name the file: hf-hub:{repo_id}/FILE")
