"""Uploads: :func:`push_folder` commits an exported folder to a Hub model repository.

:func:`plan_push` (``push_folder(..., dry_run=True)``) checks the folder and options
and describes the upload, a :class:`PushResult`, without any request; the upload
itself sends its requests from ``_upload`` only. The Hub token is read by
huggingface_hub from ``hf auth login`` or ``HF_TOKEN``; this module never prints,
logs or stores it. Failures become one-line
:class:`~timm_layerscale.errors.HubError` messages
(:func:`~timm_layerscale.files.hub_errors.hub_errors`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import HubError
from ..files.hub_errors import hub_errors, one_line
from ..files.sources import FOLDER_WEIGHTS, WEIGHTS_NAME, check_online, hub_endpoint
from ..options import command_line
from .card import CONFIG_NAME

__all__ = ["push_folder", "plan_push", "PushResult", "require_token", "check_repo_id"]

#: Files never uploaded: temporary files of an interrupted write.
_UPLOAD_IGNORE = ("**/.*.tmp-*", ".*.tmp-*")


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


def _upload(plan: PushResult) -> tuple[str, str | None, str | None]:
    """Create the repository if needed and commit the folder in ``plan``.

    Returns:
        ``(repo_url, commit_url, pr_url)``.
    """
    from huggingface_hub import HfApi

    check_online(plan.endpoint, f"uploading to {plan.repo_id}")
    with hub_errors(f"uploading to {plan.repo_id}", plan.repo_id, endpoint=plan.endpoint, revision=plan.revision):
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
        revision = f"refs/pr/{self.pr_url.rstrip('/').rsplit('/', 1)[-1]}" if self.pr_url else self.revision
        hub_id = self.repo_id + (f"@{revision}" if revision else "")
        usage = f'load it with: import timm_layerscale, timm; timm.create_model("hf-hub:{hub_id}", pretrained=True)'
        return head + "\n" + usage

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {**asdict(self), "folder": str(self.folder), "files": [list(f) for f in self.files]}


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w][\w.-]*")


def check_repo_id(repo_id: str) -> None:
    """Check that ``repo_id`` is a Hub model id, ``ORG/NAME``, before anything is sent.

    Raises:
        HubError: It is not.
    """
    from huggingface_hub.utils import validate_repo_id

    if not _REPO_ID.fullmatch(repo_id or ""):
        raise HubError(f"invalid repo id {repo_id!r}; use ORG/NAME, e.g. my-org/cait_s24_224_ls.fb_dist_in1k")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise HubError(f"invalid repo id {repo_id!r} ({one_line(e, 100)}); use ORG/NAME") from None


def _folder_files(folder: Path) -> list[tuple[str, int]]:
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.glob("**/*")) if p.is_file()}
    keep = filter_repo_objects(files, ignore_patterns=[*DEFAULT_IGNORE_PATTERNS, *_UPLOAD_IGNORE])
    return [(name, files[name]) for name in sorted(keep)]


def _head_rows(weights: Path, classifier: str) -> int | None:
    """Rows of ``classifier``'s weight in a safetensors file (its header only; no torch);
    None where it holds none or is no safetensors file."""
    from safetensors import SafetensorError, safe_open

    with (
        contextlib.suppress(OSError, SafetensorError, IndexError),
        safe_open(str(weights), framework="numpy") as f,
    ):
        return int(f.get_slice(f"{classifier}.weight").get_shape()[0])
    return None


def _architecture(folder: Path) -> str:
    """The ``architecture`` that the folder's ``config.json`` names; one timm cannot read, or
    whose class count disagrees with the weights' head or with its class names, is refused."""
    config = folder / CONFIG_NAME
    export = ("timm-layerscale", "export", "SOURCE", folder)
    again = f"export the folder again with: {command_line(export, overwrite=True)}"
    data: Any = None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(config.read_text(encoding="utf-8"))
    arch = data.get("architecture") if isinstance(data, dict) else None
    if not isinstance(arch, str) or not arch:
        raise HubError(f"{config} is not a timm config (JSON naming its 'architecture'); {again}")
    classes = data.get("num_classes")
    pretrained_cfg = data.get("pretrained_cfg")
    classifier = pretrained_cfg.get("classifier") if isinstance(pretrained_cfg, dict) else None
    rows = _head_rows(folder / WEIGHTS_NAME, classifier if isinstance(classifier, str) else "head")
    names = data.get("label_names")
    if rows is not None and classes is not None and classes != rows:
        raise HubError(
            f"{config} says num_classes {classes!r}, but {WEIGHTS_NAME} holds a head of {rows} classes, "
            f"so timm and transformers refuse to load it; set num_classes to {rows}, or {again}"
        )
    if names is not None and classes and (not isinstance(names, list) or len(names) != classes):
        count = f"{len(names)} class names" if isinstance(names, list) else "label_names that are no list"
        raise HubError(
            f"{config} holds {count} for num_classes {classes!r}, so classes would be named wrongly; "
            f"export the folder again with: {command_line(export, overwrite=True, label_names='FILE')}"
        )
    return arch


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
            folder (no ``config.json`` naming an architecture, a class count that disagrees
            with the weights' head or the class names, or no weights), missing token, 401/403
            (token), 404 (repository or revision) or network failure; one line
            saying what to do.
    """
    check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise HubError(
            f"a pull request opens against main, not revision {revision!r}; "
            f"leave out create_pr=True or revision={revision!r}"
        )
    if revision is not None and not revision.strip():
        raise HubError("revision is empty; name a branch or leave it out")
    path = Path(folder)
    if path.is_file():
        raise HubError(f"{path} is a file; pass the exported folder that holds it ({path.parent})")
    export = command_line(("timm-layerscale", "export", "SOURCE", path))
    if not path.is_dir():
        raise HubError(f"{path} is not a folder; export one first with: {export}")
    files = _folder_files(path)
    names = {name for name, _ in files}
    if CONFIG_NAME not in names or not names & set(FOLDER_WEIGHTS):
        raise HubError(
            f"{path} is not an exported model folder (it needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
            f"create it with: {export}"
        )
    arch = _architecture(path)
    plan = PushResult(
        repo_id=repo_id,
        folder=path,
        files=files,
        commit_message=commit_message or f"Upload {arch} weights (timm-layerscale {__version__})",
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


def plan_push(folder: str | os.PathLike[str], repo_id: str, **options: Any) -> PushResult:
    """Check a folder and options and describe the upload, without any request.

    The same as ``push_folder(folder, repo_id, dry_run=True, **options)``; the
    options are those of :func:`push_folder`.

    Raises:
        HubError: Bad repo id, conflicting options, or a folder that is not an
            exported model folder (no ``config.json`` naming an architecture, or no weights).
    """
    return push_folder(folder, repo_id, dry_run=True, **options)
