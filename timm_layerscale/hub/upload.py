"""Uploads: :func:`push_folder` commits an exported folder to a Hub model repository with huggingface_hub's
token (``hf auth login`` or ``HF_TOKEN``), which is never printed, logged or stored."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import HubError, one_line, option
from ..files.read import CONFIG_NAME, FOLDER_WEIGHTS, WEIGHTS_NAME, hub_errors

__all__ = ["PushResult", "check_repo_id", "push_folder", "require_token"]

_UPLOAD_IGNORE = ("**/.*.tmp-*", ".*.tmp-*")  # the temporaries of an interrupted write
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w][\w.-]*")


def require_token() -> str:
    """The Hub token, read locally (no request); :class:`~timm_layerscale.errors.HubError` if none is set."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError("no Hugging Face token found; run 'hf auth login' or set HF_TOKEN to a token with write access")
    return token


def check_repo_id(repo_id: str) -> str:
    """``repo_id``; a :class:`~timm_layerscale.errors.HubError` unless it is a Hub model id ``ORG/NAME``."""
    from huggingface_hub.utils import validate_repo_id

    if not _REPO_ID.fullmatch(repo_id or ""):
        raise HubError(f"invalid repo id {repo_id!r}; use ORG/NAME, e.g. my-org/cait_s24_224_ls.fb_dist_in1k")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise HubError(f"invalid repo id {repo_id!r} ({one_line(e, 100)}); use ORG/NAME") from None
    return repo_id


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@dataclass
class PushResult:
    """An upload: the repository, the folder, ``(path in the repository, bytes)`` of every file sent (sorted),
    the options (``revision`` ``None`` is ``main``), the Hub address, whether nothing was sent (``dry_run``),
    and the URLs a real upload sets."""

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

    def plan(self) -> str:
        """The upload as text: repository, options, message and every file with its size."""
        width = max(len(name) for name, _ in self.files)
        target = "pull request against main" if self.create_pr else f"branch {self.revision or 'main'}"
        lines = [
            f"repository: {self.repo_id} ({self.endpoint}/{self.repo_id})",
            f"visibility: {'private' if self.private else 'public'} (if the repository is created)",
            f"target:     {target}",
            f"message:    {self.commit_message}",
            f"files:      {len(self.files)}, {_human_size(sum(n for _, n in self.files))} from {self.folder}",
        ]
        return "\n".join(lines + [f"  {name:<{width}}  {_human_size(n):>10}" for name, n in self.files])

    def summary(self) -> str:
        """What happened (for a dry run, what would), for the command line."""
        if self.dry_run:
            return "dry run: nothing was sent\n" + self.plan()
        size = _human_size(sum(n for _, n in self.files))
        head = f"uploaded {len(self.files)} file(s), {size}, to {self.repo_id}: {self.pr_url or self.commit_url or self.repo_url}"
        revision = f"refs/pr/{self.pr_url.rstrip('/').rsplit('/', 1)[-1]}" if self.pr_url else self.revision
        hub_id = self.repo_id + (f"@{revision}" if revision else "")
        return (
            f'{head}\nload it with: import timm_layerscale, timm; timm.create_model("hf-hub:{hub_id}", pretrained=True)'
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "folder": str(self.folder), "files": [list(f) for f in self.files]}


def push_folder(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> PushResult:
    """Upload a folder written by :func:`~timm_layerscale.hub.export.export_folder` to ``repo_id`` (``ORG/NAME``)
    in one commit to ``revision`` (default ``main``) or a pull request against ``main`` (``create_pr``),
    creating the repository (``private`` applies then) and the branch if missing. Running it again commits
    nothing unchanged. ``dry_run`` only describes the upload: it sends nothing and reads no token.

    Raises:
        HubError: A bad repo id or options, a folder without weights or a ``config.json`` naming its
            architecture, no token, or the Hub refused or was unreachable; one line saying what to do.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise HubError(
            f"a pull request opens against main, not revision {revision!r}; leave out {option('create_pr')} or {option('revision', revision)}"
        )
    path = Path(folder)
    export = f"timm-layerscale export SOURCE {path}"
    if path.is_file():
        raise HubError(f"{path} is a file; pass the exported folder that holds it ({path.parent})")
    if not path.is_dir():
        raise HubError(f"{path} is not a folder; export one first with: {export}")
    sizes = {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.glob("**/*")) if p.is_file()}
    files = [
        (n, sizes[n])
        for n in sorted(filter_repo_objects(sizes, ignore_patterns=[*DEFAULT_IGNORE_PATTERNS, *_UPLOAD_IGNORE]))
    ]
    if CONFIG_NAME not in sizes or not sizes.keys() & set(FOLDER_WEIGHTS):
        raise HubError(
            f"{path} is not an exported model folder (it needs {CONFIG_NAME} and {WEIGHTS_NAME}); create it with: {export}"
        )
    try:
        arch = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))["architecture"]
    except (OSError, ValueError, TypeError, KeyError):
        arch = None
    if not isinstance(arch, str) or not arch:
        raise HubError(
            f"{path / CONFIG_NAME} is not a timm config (JSON naming its 'architecture'); export the folder again with: {export} --overwrite"
        )
    plan = PushResult(
        repo_id=repo_id,
        folder=path,
        files=files,
        private=private,
        create_pr=create_pr,
        endpoint=constants.ENDPOINT,
        commit_message=commit_message or f"Upload {arch} weights (timm-layerscale {__version__})",
        revision=None if revision in (None, "main") else revision,
    )
    if dry_run:
        return plan
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    with hub_errors(f"uploading to {repo_id}", repo_id, revision=plan.revision):
        if constants.is_offline_mode():  # said before asking for a token, as the first request would
            raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
        api = HfApi(token=require_token())
        plan.repo_url = str(api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True))
        if plan.revision and not create_pr:
            api.create_branch(repo_id, branch=plan.revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            repo_type="model",
            folder_path=str(path),
            commit_message=plan.commit_message,
            revision=plan.revision,
            create_pr=create_pr,
            ignore_patterns=list(_UPLOAD_IGNORE),
        )
    plan.dry_run = False
    plan.commit_url, plan.pr_url = getattr(info, "commit_url", None), getattr(info, "pr_url", None)
    return plan
