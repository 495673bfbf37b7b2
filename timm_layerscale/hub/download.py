"""Hub downloads and uploads: the package's only network code.

:func:`download_source` turns a checkpoint source (local path, ``https://`` URL or
``hf-hub:ORG/REPO[/FILE]``) into a local file, and :func:`push_folder` uploads a
folder written by :func:`timm_layerscale.hub.export.export_folder` to a Hub model
repository (:func:`plan_push` describes that upload without sending anything).

Every request to the network goes through three small functions at the top of this
module: :func:`_download_url` and :func:`_download_from_hub` (reached through
:func:`download_source`) and :func:`_upload`. Everything else here is pure or local
file I/O, so it can be tested without a network. Errors of the Hub or the network
become one-line :class:`~timm_layerscale.errors.HubError` messages that say what to
do. The Hub token is taken from ``hf auth login`` or ``HF_TOKEN`` by
huggingface_hub itself; this module never prints, logs or stores it.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from .._version import __version__
from .card import CARD_NAME, CONFIG_NAME, PLOT_NAME, WEIGHTS_NAME, build_model_card, write_config
from ..errors import HubError, LayerScaleError

__all__ = [
    "download_source",
    "push_folder",
    "PushResult",
    "build_model_card",
    "write_config",
    "hub_endpoint",
    "check_online",
    "require_token",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
    "CARD_NAME",
    "PLOT_NAME",
]


#: Files never uploaded: temporary files of an interrupted write.
_UPLOAD_IGNORE = ["**/.*.tmp-*", ".*.tmp-*"]


def hub_endpoint() -> str:
    """The Hub address: ``HF_ENDPOINT`` as set now, else huggingface_hub's default."""
    env = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    if env:
        return env
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


# =====================================================================================
# Network boundary. Nothing outside this section sends a request.
# =====================================================================================

# ---- Downloads: download_source ------------------------------------------------------


def download_source(source: str) -> Path:
    """Download a remote checkpoint source (once) and return the local file.

    Args:
        source: An ``https://`` (or ``http://``) URL, downloaded once into torch.hub's
            cache (``torch.hub.get_dir()/checkpoints/<name>``) and reused afterwards;
            or ``hf-hub:ORG/REPO[@REVISION][/FILE]``, fetched with huggingface_hub
            into its cache (``FILE`` defaults to ``model.safetensors``, else
            ``pytorch_model.bin``).

    Raises:
        HubError: A download failed; the message says whether to check the
            address, log in, or retry.
    """
    if source.startswith(("https://", "http://")):
        return _download_url(source)
    repo_id, revision, filename = _parse_hub_spec(source)
    return _download_from_hub(repo_id, revision, filename)


def _parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    rest = spec[len("hf-hub:"):].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise HubError(f"{spec!r} is not a Hub source; write hf-hub:ORG/REPO or hf-hub:ORG/REPO/FILE")
    repo_id = "/".join(parts[:2])
    revision = None
    if "@" in repo_id:
        repo_id, revision = repo_id.split("@", 1)
    filename = "/".join(parts[2:]) or None
    return repo_id, revision, filename


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
    """Where :func:`download_source` keeps the download of ``url``: torch.hub's checkpoint cache."""
    import torch.hub

    name = os.path.basename(urlparse(url).path)
    if not name:
        raise HubError(f"cannot tell a file name from {url}; give the URL of the checkpoint file")
    return Path(torch.hub.get_dir()) / "checkpoints" / name


def _download_url(url: str) -> Path:
    """Download ``url`` into torch.hub's checkpoint cache (reused when already there)."""
    import torch.hub

    from .. import progress

    target = cached_url_path(url)
    if target.is_file() and target.stat().st_size > 0:
        return target
    check_online(url, f"downloading {url}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(url, str(target), progress=progress.enabled())
    except Exception as e:  # urllib raises HTTPError, URLError, OSError, ValueError
        code = getattr(e, "code", None)
        if code == 404:
            raise HubError(f"could not download {url}: not found (404); check the URL") from e
        reason = getattr(e, "reason", None) or e
        raise HubError(f"could not download {url}: {_one_line(reason)}; check the network and retry") from e
    return target


def _download_from_hub(repo_id: str, revision: str | None, filename: str | None) -> Path:
    """Fetch one file of a Hub repository into huggingface_hub's cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    from huggingface_hub.errors import LocalEntryNotFoundError

    what = f"hf-hub:{repo_id}" + (f"@{revision}" if revision else "")
    candidates = [filename] if filename else [WEIGHTS_NAME, "pytorch_model.bin"]
    endpoint = hub_endpoint()
    with _hub_errors(f"downloading {what}", repo_id, download=True):
        if _offline() or not _resolves(endpoint):
            # No network: serve the cache at once instead of retrying for half a minute.
            for name in candidates:
                try:
                    return Path(hf_hub_download(repo_id, name, revision=revision, endpoint=endpoint, local_files_only=True))
                except LocalEntryNotFoundError:
                    continue
            check_online(endpoint, f"downloading {what} (not in the local cache)")
        for name in candidates:
            try:
                return Path(hf_hub_download(repo_id, name, revision=revision, endpoint=endpoint))
            except RemoteEntryNotFoundError:
                continue
    raise HubError(f"{what} has no file {' or '.join(candidates)}; name the file: hf-hub:{repo_id}/FILE")


# ---- Uploads: the one function that talks to the Hub for push -----------------------


def require_token() -> str:
    """The Hub token of ``hf auth login`` or ``HF_TOKEN``, read locally (no request, never printed).

    Raises:
        HubError: No token is set.
    """
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError("no Hugging Face token found; run 'hf auth login' or set HF_TOKEN to a token with write access")
    return token


def _upload(plan: "PushResult") -> tuple[str, str | None, str | None]:
    """Create the repository if needed and commit the folder in ``plan``.

    Returns:
        ``(repo_url, commit_url, pr_url)``.
    """
    from huggingface_hub import HfApi

    check_online(plan.endpoint, f"uploading to {plan.repo_id}")
    with _hub_errors(f"uploading to {plan.repo_id}", plan.repo_id, revision=plan.revision):
        token = require_token()
        api = HfApi(endpoint=plan.endpoint, token=token)
        repo_url = api.create_repo(plan.repo_id, repo_type="model", private=plan.private, exist_ok=True)
        if plan.revision and not plan.create_pr:
            api.create_branch(plan.repo_id, branch=plan.revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            repo_id=plan.repo_id,
            repo_type="model",
            folder_path=str(plan.folder),
            commit_message=plan.commit_message,
            revision=plan.revision,
            create_pr=plan.create_pr,
            ignore_patterns=list(_UPLOAD_IGNORE),
        )
    return str(repo_url), getattr(info, "commit_url", None), getattr(info, "pr_url", None)


# ---- Error translation ---------------------------------------------------------------

_NETWORK_ERROR_NAMES = {
    "ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout",
    "TimeoutException", "TransportError", "NetworkError", "ProtocolError", "RemoteProtocolError",
    "ProxyError", "ReadError", "WriteError", "URLError", "SSLError", "TimeoutError",
}


def _is_network_error(e: BaseException) -> bool:
    return any(c.__name__ in _NETWORK_ERROR_NAMES for c in type(e).__mro__)


def _one_line(x: Any, limit: int = 160) -> str:
    text = " ".join(str(x).split())
    return text[: limit - 3] + "..." if len(text) > limit else text


def _http_message(status: int | None, action: str, repo_id: str, revision: str | None, server: str | None) -> str:
    ns = repo_id.split("/", 1)[0]
    detail = f" ({_one_line(server, 120)})" if server else ""
    if status == 401:
        return (
            f"the Hub rejected the token (401 Unauthorized) while {action}; "
            "run 'hf auth login' (or set HF_TOKEN) with a valid token that has write access"
        )
    if status == 403:
        return (
            f"the token may not write to {repo_id} (403 Forbidden); use a token with write access "
            f"to the '{ns}' namespace ('hf auth login') or check the repo id"
        )
    if status == 404:
        rev = f" or revision {revision!r}" if revision else ""
        return f"{repo_id}{rev} was not found on the Hub (404) while {action}; check the repo id{' and revision' if revision else ''}"
    if status == 429 or (status is not None and status >= 500):
        return f"the Hub answered {status} while {action}{detail}; retry in a few minutes"
    return f"the Hub answered {status} while {action}{detail}; check the repo id and options, then retry"


def _download_http_message(status: int | None, action: str, repo_id: str, server: str | None) -> str:
    if status in (401, 403, 404):
        return (
            f"{repo_id} was not found or is not accessible ({status}) while {action}; check the repo id, "
            "or run 'hf auth login' if it is private"
        )
    detail = f" ({_one_line(server, 120)})" if server else ""
    return f"the Hub answered {status} while {action}{detail}; check the network and retry"


@contextlib.contextmanager
def _hub_errors(action: str, repo_id: str, *, revision: str | None = None, download: bool = False) -> Iterator[None]:
    """Translate huggingface_hub and network exceptions into one-line HubErrors.

    Args:
        action: What was being done, for the message (``"uploading to ORG/NAME"``).
        repo_id: The repository.
        revision: The branch, named in a 404 message.
        download: Word 401/403/404 for reading rather than writing.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    try:
        yield
    except LayerScaleError:
        raise
    except GatedRepoError as e:
        raise HubError(f"{repo_id} is gated; accept its terms on the Hub, run 'hf auth login', then retry") from e
    except LocalTokenNotFoundError as e:
        raise HubError("no Hugging Face token found; run 'hf auth login' or set HF_TOKEN") from e
    except OfflineModeIsEnabled as e:
        raise HubError(f"HF_HUB_OFFLINE is set, so {action} is not possible; unset it and retry") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if getattr(e, "response", None) is not None else None
        server = getattr(e, "server_message", None)
        if download:
            raise HubError(_download_http_message(status, action, repo_id, server)) from e
        raise HubError(_http_message(status, action, repo_id, revision, server)) from e
    except Exception as e:
        if type(e).__name__ == "LocalEntryNotFoundError" and constants.is_offline_mode():
            raise HubError(
                f"HF_HUB_OFFLINE is set and the cache cannot serve {action}; unset HF_HUB_OFFLINE, check the network and retry"
            ) from e
        if _is_network_error(e) or type(e).__name__ == "LocalEntryNotFoundError":
            raise HubError(
                f"could not reach the Hub at {hub_endpoint()} while {action} ({_one_line(e, 100)}); "
                "check the network (and HF_ENDPOINT) and retry"
            ) from e
        if isinstance(e, ValueError):
            raise HubError(f"{action} failed: {_one_line(e)}; fix the folder or options and retry") from e
        raise


# =====================================================================================
# Upload plan (pure)
# =====================================================================================


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@dataclass
class PushResult:
    """An upload: what it sends (the plan) and, once done, where it went.

    Attributes:
        repo_id: Target repository, ``ORG/NAME``.
        folder: The uploaded folder.
        files: ``(path in repo, size in bytes)`` of every file sent, sorted.
        commit_message: The commit message.
        private: Whether a newly created repository is private.
        revision: Branch committed to (created if missing); ``None`` is ``main``.
        create_pr: Whether the commit opens a pull request.
        endpoint: The Hub address.
        dry_run: Nothing was sent.
        repo_url, commit_url, pr_url: Set after a real upload.
    """

    repo_id: str
    folder: Path
    files: list[tuple[str, int]]
    commit_message: str
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    endpoint: str = ""
    dry_run: bool = True
    repo_url: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def plan(self) -> str:
        """The upload as text: repository, options, commit message and every file with its size."""
        width = max(len(name) for name, _ in self.files)
        target = self.revision or "main"
        lines = [
            f"repository: {self.repo_id} ({self.endpoint}/{self.repo_id})",
            f"visibility: {'private' if self.private else 'public'} (if the repository is created)",
            f"target:     {'pull request against main' if self.create_pr else f'branch {target}'}",
            f"message:    {self.commit_message}",
            f"files:      {len(self.files)}, {_human_size(self.total_bytes)} from {self.folder}",
        ]
        lines += [f"  {name:<{width}}  {_human_size(size):>10}" for name, size in self.files]
        return "\n".join(lines)

    def summary(self) -> str:
        """What happened (or, for a dry run, what would happen), for the command line."""
        if self.dry_run:
            return "dry run: nothing was sent\n" + self.plan()
        done = self.pr_url or self.commit_url or self.repo_url
        head = f"uploaded {len(self.files)} file(s), {_human_size(self.total_bytes)}, to {self.repo_id}: {done}"
        usage = f'load it with: import timm_layerscale, timm; timm.create_model("hf-hub:{self.repo_id}", pretrained=True)'
        return head + "\n" + usage

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id, "folder": str(self.folder), "files": [list(f) for f in self.files],
            "commit_message": self.commit_message, "private": self.private, "revision": self.revision,
            "create_pr": self.create_pr, "endpoint": self.endpoint, "dry_run": self.dry_run,
            "repo_url": self.repo_url, "commit_url": self.commit_url, "pr_url": self.pr_url,
        }


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w][\w.-]*")


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import validate_repo_id

    if not _REPO_ID.fullmatch(repo_id or ""):
        raise HubError(f"invalid repo id {repo_id!r}; use ORG/NAME, e.g. my-org/cait_s24_224_ls.fb_dist_in1k")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise HubError(f"invalid repo id {repo_id!r} ({_one_line(e, 100)}); use ORG/NAME") from None


def _folder_files(folder: Path) -> list[tuple[str, int]]:
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.glob("**/*")) if p.is_file()}
    keep = filter_repo_objects(files, ignore_patterns=list(DEFAULT_IGNORE_PATTERNS) + _UPLOAD_IGNORE)
    return [(name, files[name]) for name in sorted(keep)]


def _default_commit_message(folder: Path) -> str:
    arch = None
    try:
        import json

        arch = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")).get("architecture")
    except (OSError, ValueError, AttributeError):
        pass
    what = f"{arch} weights" if arch else "model folder"
    return f"Upload {what} (timm-layerscale {__version__})"


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> PushResult:
    """Upload an exported folder to a Hub model repository.

    Creates the repository if it does not exist (``private`` applies only then),
    creates ``revision`` as a branch if missing, and commits every file of the
    folder in one commit (or a pull request). Running it again is safe: an
    existing repository is reused and unchanged files are not committed again.
    The token comes from ``hf auth login`` or ``HF_TOKEN``; it is never printed,
    logged or written anywhere.

    Args:
        folder: Folder written by :func:`~timm_layerscale.hub.export.export_folder`.
        repo_id: ``ORG/NAME``.
        private: Create the repository as private.
        revision: Branch to commit to (default ``main``).
        create_pr: Open a pull request against ``main`` instead of committing.
        commit_message: Commit message (default names the architecture).
        dry_run: Only describe the upload (files, sizes, repository, message);
            send nothing and read no token.

    Returns:
        A :class:`PushResult`; ``summary()`` prints it.

    Raises:
        HubError: Bad repo id or options, a folder that is not an exported model
            folder (no ``config.json`` or no weights), missing token, 401/403
            (token), 404 (repository or revision) or network failure; one line
            saying what to do.
    """
    _check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise HubError("--create-pr opens a pull request against main; drop --revision or --create-pr")
    if revision is not None and not revision.strip():
        raise HubError("--revision is empty; name a branch or leave it out")
    path = Path(folder)
    if not path.is_dir():
        raise HubError(f"{path} is not a folder; export one first with: timm-layerscale export SOURCE {path}")
    files = _folder_files(path)
    names = {name for name, _ in files}
    if CONFIG_NAME not in names or not names & {WEIGHTS_NAME, "pytorch_model.bin"}:
        raise HubError(
            f"{path} is not an exported model folder (it needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
            f"create it with: timm-layerscale export SOURCE {path}"
        )
    plan = PushResult(
        repo_id=repo_id,
        folder=path,
        files=files,
        commit_message=commit_message or _default_commit_message(path),
        private=private,
        revision=None if revision in (None, "main") else revision,
        create_pr=create_pr,
        endpoint=hub_endpoint(),
        dry_run=True,
    )
    if dry_run:
        return plan
    repo_url, commit_url, pr_url = _upload(plan)
    plan.dry_run = False
    plan.repo_url, plan.commit_url, plan.pr_url = repo_url, commit_url, pr_url
    return plan


def plan_push(folder: str | os.PathLike, repo_id: str, **options: Any) -> PushResult:
    """Check a folder and options and describe the upload, without any request.

    The same as ``push_folder(folder, repo_id, dry_run=True, **options)``; the
    options are those of :func:`push_folder`.

    Raises:
        HubError: Bad repo id, conflicting options, or a folder that is not an
            exported model folder (no ``config.json`` or no weights).
    """
    return push_folder(folder, repo_id, dry_run=True, **options)
