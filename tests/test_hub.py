"""Tests for the Hub package: downloads, uploads, error messages, export folder and model card (timm_layerscale.hub)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

from helpers import assert_one_line_error, cli, damage_inside
from timm_layerscale.errors import HubError, OutputExistsError
from timm_layerscale.files.read import cached_url_path, resolve_source, source_config
from timm_layerscale.hub.export import export_folder
from timm_layerscale.hub.upload import push_folder
from timm_layerscale.parity.tolerance import VerifyOptions

TOKEN = "hf_LoopbackSecretToken0123456789abcdef"

pytestmark = pytest.mark.usefixtures("few_inputs")  # one seeded image: these tests do not count them


class FakeHub:
    """A recording stand-in for the Hub API on 127.0.0.1 (a fresh port each time)."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.requests: list[dict[str, Any]] = []
        self.repos: dict[str, dict[str, Any]] = {}
        self.commits: list[dict[str, Any]] = []
        self.fail: dict[str, int] = {}  # path substring -> status to answer with
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_POST(self) -> None:
                hub._handle(self, "POST")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- request handling ------------------------------------------------------------

    def _reply(self, h: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parsed = urlparse(h.path)
        path = unquote(parsed.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        record = {
            "method": method,
            "path": path,
            "query": parse_qs(parsed.query),
            "auth": h.headers.get("Authorization"),
            "body": raw,
        }
        with self.lock:
            self.requests.append(record)
        for fragment, status in self.fail.items():
            if fragment in path:
                return self._reply(h, status, {"error": f"simulated {status}"})
        if method in ("GET", "HEAD") and "/resolve/" in path:
            return self._resolve(h, method, path)
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._reply(h, 401, {"error": "Invalid credentials in Authorization header"})
        try:
            status, body = self._route(method, path, parsed.query, raw)
        except KeyError as e:
            status, body = 404, {"error": f"not found: {e}"}
        self._reply(h, status, body)

    def _route(self, method: str, path: str, query: str, raw: bytes) -> tuple[int, Any]:
        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}
        if method == "POST" and path == "/api/repos/create":
            payload = json.loads(raw)
            repo_id = f"{payload['organization']}/{payload['name']}"
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = {"payload": payload, "branches": {"main": {}}, "prs": {}}
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(.*))?", path)
        if not m:
            return 404, {"error": f"no route for {path}"}
        repo_id, rest = m.group(1), m.group(2) or ""
        repo = self.repos[repo_id]
        if method == "GET" and (rest == "" or rest.startswith("revision/")):
            rev = rest[len("revision/") :] or "main"
            files = repo["branches"][rev]
            head = self._head(repo_id, rev)
            return 200, {"id": repo_id, "sha": head, "private": False, "siblings": [{"rfilename": f} for f in files]}
        if method == "POST" and rest.startswith("branch/"):
            branch = rest[len("branch/") :]
            if branch in repo["branches"]:
                return 409, {"error": "Reference already exists"}
            repo["branches"][branch] = dict(repo["branches"]["main"])
            return 200, {}
        if method == "POST" and rest.startswith("preupload/"):
            rev = rest[len("preupload/") :]
            files = repo["branches"].get(rev, repo["branches"]["main"])
            out = []
            for f in json.loads(raw)["files"]:
                old = files.get(f["path"])
                oid = hashlib.sha1(b"blob %d\0" % len(old) + old).hexdigest() if old is not None else None
                out.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
            return 200, {"files": out, "commitOid": self._head(repo_id, rev)}
        if method == "POST" and rest.startswith("commit/"):
            rev = rest[len("commit/") :]
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
            header = lines[0]["value"]
            files = {}
            for item in lines[1:]:
                if item["key"] != "file":
                    return 400, {"error": f"unsupported commit operation {item['key']}"}
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo["branches"].setdefault(rev, dict(repo["branches"]["main"])).update(files)
            oid = hashlib.sha1(f"{repo_id}{rev}{len(self.commits)}".encode()).hexdigest()
            self.commits.append(
                {"repo_id": repo_id, "revision": rev, "summary": header["summary"], "files": files, "oid": oid}
            )
            pr = re.fullmatch(r"refs/pr/(\d+)", rev)
            pr_url = f"{self.url}/{repo_id}/discussions/{pr.group(1)}" if pr else None
            return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url}
        if method == "POST" and rest == "discussions":
            payload = json.loads(raw)
            num = len(repo["prs"]) + 1
            repo["prs"][num] = payload
            repo["branches"][f"refs/pr/{num}"] = dict(repo["branches"]["main"])
            return 200, {"num": num, "url": f"{self.url}/{repo_id}/discussions/{num}"}
        if method == "GET" and rest.startswith("discussions/"):
            num = int(rest.split("/")[1])
            pr = repo["prs"][num]
            return 200, {
                "num": num, "title": pr["title"], "status": "draft", "isPullRequest": True, "author": {"name": "t"},
                "createdAt": "2024-01-01T00:00:00.000Z", "repo": {"name": repo_id, "type": "model"}, "events": [],
                "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [], "diff": "", "pinned": False,
            }  # fmt: skip
        return 404, {"error": f"no route for {method} {path}"}

    def _resolve(self, h: BaseHTTPRequestHandler, method: str, path: str) -> None:
        """File downloads: ``/{repo_id}/resolve/{revision}/{filename}`` (public repositories)."""
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/(refs/pr/\d+|[^/]+)/(.+)", path)
        repo = self.repos.get(m.group(1)) if m else None
        branches = repo["branches"] if repo else {}
        branch = branches.get(m.group(2)) if m else None
        if m and branch is None:  # a commit id, as clients resolve a branch to before fetching: that branch's head
            branch = next((f for b, f in branches.items() if self._head(m.group(1), b) == m.group(2)), None)
        data = branch.get(m.group(3)) if branch is not None and m else None
        if data is None:
            missing = "RepoNotFound" if repo is None else "RevisionNotFound" if branch is None else "EntryNotFound"
            h.send_response(404)
            h.send_header("X-Error-Code", missing)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        assert m is not None
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("ETag", '"' + hashlib.sha1(data).hexdigest() + '"')
        h.send_header("X-Repo-Commit", self._head(m.group(1), m.group(2)))
        h.end_headers()
        if method == "GET":
            h.wfile.write(data)

    def _head(self, repo_id: str, rev: str) -> str:
        for c in reversed(self.commits):
            if c["repo_id"] == repo_id and c["revision"] == rev:
                return c["oid"]
        return hashlib.sha1(f"{repo_id}@{rev}".encode()).hexdigest()  # a branch's files put in place by a test

    # -- helpers for assertions ------------------------------------------------------

    def paths(self) -> list[str]:
        return [f"{r['method']} {r['path']}" for r in self.requests]


def _free_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with FakeHub() as server:
        _point_at(monkeypatch, server.url, tmp_path)
        yield server


def _point_at(monkeypatch: pytest.MonkeyPatch, url: str, tmp_path: Path, token: str | None = TOKEN) -> None:
    monkeypatch.setenv("HF_ENDPOINT", url)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))
    _endpoint_read_on_import(monkeypatch, url)


def _endpoint_read_on_import(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """huggingface_hub uses the ``HF_ENDPOINT`` it read when it was imported: as if it had been set before."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(
        huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A small folder shaped like an export: weights, config.json, model card."""
    d = tmp_path / "export"
    d.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32)}, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"architecture": "cait_xxs24_224_ls", "num_classes": 1000}))
    (d / "README.md").write_text("---\nlibrary_name: timm\nlicense: apache-2.0\n---\n\n# test card\n")
    return d


def _no_token_anywhere(*texts: str, folder: Path | None = None) -> None:
    for text in texts:
        assert TOKEN not in text
    if folder is not None:
        for p in folder.rglob("*"):
            if p.is_file():
                assert TOKEN.encode() not in p.read_bytes(), p


@pytest.mark.compat
def test_push_creates_repo_and_commits_every_file(hub: FakeHub, folder: Path, capsys, caplog) -> None:
    caplog.set_level("DEBUG")
    res = push_folder(folder, "my-org/cait_xxs24_224_ls.fb_dist_in1k", commit_message="Add converted weights")
    assert not res.dry_run
    assert res.commit_url and res.commit_url.startswith(hub.url)
    create = [r for r in hub.requests if r["path"] == "/api/repos/create"]
    assert len(create) == 1
    payload = json.loads(create[0]["body"])
    assert (payload["organization"], payload["name"]) == ("my-org", "cait_xxs24_224_ls.fb_dist_in1k")
    assert payload.get("visibility", "public") == "public"
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    assert commit["summary"] == "Add converted weights"
    assert commit["revision"] == "main"
    assert commit["files"] == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert all(
        r["auth"] == f"Bearer {TOKEN}" for r in hub.requests if r["path"].startswith(("/api/repos", "/api/models"))
    )
    out, err = capsys.readouterr()
    _no_token_anywhere(out, err, res.summary(), json.dumps(res.to_dict()), caplog.text, folder=folder)


@pytest.mark.compat
def test_push_again_is_safe_and_commits_nothing_new(hub: FakeHub, folder: Path) -> None:
    push_folder(folder, "my-org/model")
    push_folder(folder, "my-org/model")
    assert sum(r["path"] == "/api/repos/create" for r in hub.requests) == 2
    assert len(hub.commits) == 1
    (folder / "README.md").write_text("---\nlibrary_name: timm\n---\n\n# changed card\n")
    push_folder(folder, "my-org/model")
    assert len(hub.commits) == 2
    assert set(hub.commits[1]["files"]) == {"README.md"}


def test_push_private_revision_and_default_message(hub: FakeHub, folder: Path) -> None:
    res = push_folder(folder, "my-org/private-model", private=True, revision="v2")
    payload = json.loads(next(r for r in hub.requests if r["path"] == "/api/repos/create")["body"])
    assert payload["visibility"] == "private"
    assert "POST /api/models/my-org/private-model/branch/v2" in hub.paths()
    assert hub.commits[0]["revision"] == "v2"
    assert "cait_xxs24_224_ls" in hub.commits[0]["summary"]
    assert 'create_model("hf-hub:my-org/private-model@v2"' in res.summary()  # the branch, not main


def test_push_create_pr_opens_a_pull_request(hub: FakeHub, folder: Path) -> None:
    res = push_folder(folder, "my-org/pr-model", create_pr=True, commit_message="Convert weights")
    assert hub.commits[0]["revision"] == "refs/pr/1"
    assert hub.repos["my-org/pr-model"]["prs"][1]["title"] == "Convert weights"
    assert res.pr_url and res.pr_url.endswith("/discussions/1")
    assert 'create_model("hf-hub:my-org/pr-model@refs/pr/1"' in res.summary()  # the files are on the PR


def test_dry_run_lists_the_plan_and_sends_nothing(hub: FakeHub, folder: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    res = push_folder(folder, "my-org/model", dry_run=True, commit_message="msg here")
    assert hub.requests == []
    text = res.summary()
    assert "dry run" in text and "my-org/model" in text and "msg here" in text
    for p in folder.iterdir():
        assert p.name in text
    assert dict(res.files) == {p.name: p.stat().st_size for p in folder.iterdir()}


@pytest.mark.parametrize(
    "fail, token, expect",
    [
        (None, "hf_wrong_token_value", "hf auth login"),
        ({"/api/repos/create": 403, "/api/models/": 403}, TOKEN, "write access"),
        ({"/preupload/": 404}, TOKEN, "check the repo id"),
        ({"/preupload/": 503}, TOKEN, "retry"),
    ],
    ids=["401", "403", "404", "503"],
)
def test_http_errors_become_one_line_hub_errors(hub: FakeHub, folder: Path, monkeypatch, fail, token, expect) -> None:
    hub.fail = dict(fail or {})
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)
    with pytest.raises(HubError) as info:
        push_folder(folder, "my-org/model")
    message = str(info.value)
    assert "\n" not in message
    assert expect in message
    assert TOKEN not in message and token not in message
    assert hub.commits == []


def test_missing_token_says_how_to_log_in(hub: FakeHub, folder: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match="hf auth login"):
        push_folder(folder, "my-org/model")
    assert hub.requests == []


@pytest.mark.compat
def test_network_failure_says_retry(folder: Path, monkeypatch, tmp_path: Path) -> None:
    _point_at(monkeypatch, _free_port_url(), tmp_path)
    with pytest.raises(HubError) as info:
        push_folder(folder, "my-org/model")
    message = str(info.value)
    assert "could not reach the Hub" in message and "retry" in message and "\n" not in message


@pytest.mark.parametrize(
    "repo_id, kwargs, match",
    [
        ("no-namespace", {}, "ORG/NAME"),
        ("a/b/c", {}, "ORG/NAME"),
        ("my-org/model", {"create_pr": True, "revision": "dev"}, "pull request"),
    ],
)
def test_bad_options_fail_before_any_request(hub: FakeHub, folder: Path, repo_id, kwargs, match) -> None:
    with pytest.raises(HubError, match=match):
        push_folder(folder, repo_id, **kwargs)
    assert hub.requests == []


def test_push_refuses_a_folder_that_is_not_an_export(hub: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    with pytest.raises(HubError, match="timm-layerscale export"):
        push_folder(tmp_path / "stuff", "my-org/model")
    with pytest.raises(HubError, match="not a folder"):
        push_folder(tmp_path / "missing", "my-org/model")
    with pytest.raises(HubError, match=r"notes.txt is a file; pass the exported folder that holds it \(.*stuff\)$"):
        push_folder(tmp_path / "stuff" / "notes.txt", "my-org/model")
    # a config.json that timm cannot read (edited by hand) is refused before anything is sent
    (tmp_path / "stuff" / "model.safetensors").write_bytes(b"x")
    for text in ("{", "[]", '{"num_classes": 3}'):
        (tmp_path / "stuff" / "config.json").write_text(text)
        with pytest.raises(HubError, match=r"config.json is not a timm config \(JSON naming its 'architecture'\)"):
            push_folder(tmp_path / "stuff", "my-org/model")
    assert hub.requests == []


def test_plan_skips_temporary_and_git_files(folder: Path) -> None:
    (folder / ".model.safetensors.tmp-1234abcd").write_bytes(b"partial")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref")
    names = [name for name, _ in push_folder(folder, "my-org/model", dry_run=True).files]
    assert names == ["README.md", "config.json", "model.safetensors"]


def _http_error(cls: type, status: int) -> Exception:
    from huggingface_hub.utils import httpx

    response = httpx.Response(status, request=httpx.Request("GET", "https://hub.example/api/models/my-org/model"))
    return cls(f"{status} Client Error.", response=response)


@pytest.mark.compat
def test_the_most_specific_exception_type_answers(monkeypatch) -> None:
    from huggingface_hub.errors import (
        BadRequestError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )
    from huggingface_hub.utils import httpx

    from timm_layerscale.errors import HubError
    from timm_layerscale.files.read import hub_errors

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example")
    cases = [
        (OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE is set, so uploading to my-org/model"),  # a ConnectionError
        (_http_error(GatedRepoError, 403), "my-org/model is gated"),  # a RepositoryNotFoundError
        (_http_error(BadRequestError, 400), "the Hub answered 400 while uploading"),  # a ValueError
        (_http_error(HfHubHTTPError, 401), "the Hub rejected the token (401 Unauthorized)"),
        (LocalEntryNotFoundError("cannot find it"), "could not reach the Hub at https://hub.example"),
        (httpx.ConnectError("[Errno 111] Connection refused"), "could not reach the Hub at https://hub.example"),
        (ValueError("bad folder"), "uploading to my-org/model failed: bad folder"),
    ]
    for error, expect in cases:
        with pytest.raises(HubError) as info, hub_errors("uploading to my-org/model", "my-org/model"):
            raise error
        assert str(info.value).startswith(expect), (type(error).__name__, str(info.value))
    with pytest.raises(RuntimeError), hub_errors("uploading to my-org/model", "my-org/model"):
        raise RuntimeError("a bug")


def test_resolve_source_downloads_a_url_once_and_says_when_it_is_wrong(tmp_path: Path, monkeypatch) -> None:
    """A real download from a web server on 127.0.0.1 into torch.hub's cache, read from there
    the second time; a missing file is one line that says to check the URL, and leaves nothing."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    (tmp_path / "site" / "deit").mkdir(parents=True)
    (tmp_path / "site" / "deit" / "model.pth").write_bytes(b"weights" * 1000)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "torch-hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path / "site"))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}/deit"
            got = resolve_source(base + "/model.pth")
            assert got == cached_url_path(base + "/model.pth") and got.read_bytes() == b"weights" * 1000
            (tmp_path / "site" / "deit" / "model.pth").unlink()
            assert resolve_source(base + "/model.pth") == got  # from the cache
            with pytest.raises(HubError) as info:
                resolve_source(base + "/modle.pth")
            assert (
                str(info.value) == f"could not download {base}/modle.pth: HTTP Error 404: File not found; check the URL"
            )
            assert not cached_url_path(base + "/modle.pth").exists()
        finally:
            server.shutdown()


def test_a_hub_config_json_is_none_only_where_the_hub_says_not_found(hub: FakeHub, monkeypatch) -> None:
    """A repository without ``config.json`` exports without class names; a refusal or a server error says so."""
    import huggingface_hub.file_download

    monkeypatch.setattr(huggingface_hub.file_download, "_DEFAULT_RETRY_ON_STATUS_CODES", ())  # no back-off
    hub.repos["my-org/st"] = {"branches": {"main": {"model.safetensors": b"safe"}}, "prs": {}}
    assert source_config("hf-hub:my-org/st") is None
    for status, expect in ((403, "not found or is not accessible (403)"), (500, "the Hub answered 500")):
        hub.fail["config.json"] = status
        with pytest.raises(HubError, match=re.escape(expect)):
            source_config("hf-hub:my-org/st")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert source_config("hf-hub:my-org/st") is None  # offline, nothing cached


@pytest.mark.compat
def test_resolve_source_downloads_from_the_hub(hub: FakeHub) -> None:
    hub.repos["my-org/st"] = {"branches": {"main": {"model.safetensors": b"safe", "other.bin": b"other"}}, "prs": {}}
    hub.repos["my-org/bin"] = {"branches": {"main": {"pytorch_model.bin": b"pickle"}}, "prs": {}}
    hub.repos["my-org/empty"] = {"branches": {"main": {}}, "prs": {}}
    assert resolve_source("hf-hub:my-org/st").read_bytes() == b"safe"
    assert resolve_source("hf-hub:my-org/st@main/other.bin").read_bytes() == b"other"
    hub.repos["my-org/st"]["branches"]["refs/pr/1"] = {"model.safetensors": b"pr", "other.bin": b"pr other"}
    assert resolve_source("hf-hub:my-org/st@refs/pr/1").read_bytes() == b"pr"
    assert resolve_source("hf-hub:my-org/st@refs/pr/1/other.bin").read_bytes() == b"pr other"
    assert resolve_source("hf-hub:my-org/bin").read_bytes() == b"pickle"
    with pytest.raises(HubError, match=r"has no file model\.safetensors or .*index\.json or pytorch_model\.bin"):
        resolve_source("hf-hub:my-org/empty")
    with pytest.raises(HubError, match=r"not found or is not accessible .*check the repo id"):
        resolve_source("hf-hub:my-org/does-not-exist")
    with pytest.raises(HubError, match=r"my-org/st has no revision 'v9' while downloading .*check the revision"):
        resolve_source("hf-hub:my-org/st@v9")


def test_a_sharded_repository_downloads_its_shards_beside_the_index(hub: FakeHub) -> None:
    from safetensors.torch import save

    from timm_layerscale.files.read import load_checkpoint

    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"weight_map": {"a": names[0], "b": names[1]}}).encode()
    files = {names[0]: save({"a": torch.ones(2)}), names[1]: save({"b": torch.zeros(3)})}
    hub.repos["my-org/sharded"] = {"branches": {"main": {"model.safetensors.index.json": index, **files}}, "prs": {}}
    path = resolve_source("hf-hub:my-org/sharded")
    assert path.name == "model.safetensors.index.json"
    assert sorted(p.name for p in path.parent.iterdir()) == [*names, path.name]
    assert {k: v.tolist() for k, v in load_checkpoint(path).items()} == {"a": [1.0, 1.0], "b": [0.0, 0.0, 0.0]}


@pytest.mark.compat
def test_pretrained_downloads_what_the_registered_config_names(hub: FakeHub, tmp_path: Path, monkeypatch) -> None:
    """``create_model(NAME, pretrained=True)`` with nothing overlaid: timm downloads the file the
    registered config names (timm's CaiT copy; a ViT-5 training dict) and the filter maps it;
    the next build reads the cache, offline."""
    import argparse

    import timm
    from safetensors.torch import save

    from helpers import images, randomize
    from timm_layerscale.conversion.rules import to_gamma
    from timm_layerscale.families import get_variant
    from timm_layerscale.families.vit5 import rope_buffers

    _endpoint_read_on_import(monkeypatch, hub.url)
    theirs = randomize(timm.create_model("cait_xxs24_224"), seed=3).eval()
    sd = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    hub.repos["timm/cait_xxs24_224.fb_dist_in1k"] = {"branches": {"main": {"model.safetensors": save(sd)}}, "prs": {}}
    tiny: dict[str, Any] = dict(embed_dim=64, depth=2, num_heads=2, img_size=32)
    weights, ema = (randomize(timm.create_model("vit5_small_patch16_224", **tiny), seed=s).eval() for s in (4, 5))
    small = dataclasses.replace(get_variant("vit5_small_patch16_224"), embed_dim=64, depth=2, num_heads=2)
    model_sd, ema_sd = (to_gamma(m.state_dict(), "vit5") | rope_buffers(small) for m in (weights, ema))
    buf = io.BytesIO()
    torch.save({"model": model_sd, "model_ema": ema_sd, "epoch": 9, "args": argparse.Namespace(lr=1.0)}, buf)
    hub.repos["FengWang3211/ViT-5"] = {"branches": {"main": {"vit5_small_patch16_224.pth": buf.getvalue()}}, "prs": {}}
    cache, x, x_small = tmp_path / "cache", images(2, 224), images(2, 32)

    def load_and_compare() -> set[str]:
        hub.requests.clear()
        ours = timm.create_model("cait_xxs24_224_ls", pretrained=True, cache_dir=cache).eval()
        with torch.inference_mode():
            assert torch.equal(ours(x), theirs(x))
        for tag, expected in (("in1k", weights), ("in1k_ema", ema)):
            model = timm.create_model(f"vit5_small_patch16_224.{tag}", pretrained=True, cache_dir=cache, **tiny)
            with torch.inference_mode():
                assert torch.equal(model.eval()(x_small), expected(x_small)), tag
        return {r["path"] for r in hub.requests if "/resolve/" in r["path"] and r["method"] == "GET"}

    assert load_and_compare() == {
        "/timm/cait_xxs24_224.fb_dist_in1k/resolve/main/model.safetensors",
        "/FengWang3211/ViT-5/resolve/main/vit5_small_patch16_224.pth",
    }
    assert sorted(p.name for p in cache.glob("models--*")) == [
        "models--FengWang3211--ViT-5",
        "models--timm--cait_xxs24_224.fb_dist_in1k",
    ]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert load_and_compare() == set()


def test_resolve_source_rejects_a_bad_hub_spec() -> None:
    with pytest.raises(HubError, match="hf-hub:ORG/REPO"):
        resolve_source("hf-hub:only-one-part")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """One full export of a seeded official-layout cait_xxs24_224, pushed to a FakeHub."""
    from timm_layerscale.demo import write_official_checkpoint

    root = tmp_path_factory.mktemp("export")
    source = root / "XXS24_224.pth"
    reference = write_official_checkpoint(source, "cait_xxs24_224", seed=0)
    with FakeHub() as server, pytest.MonkeyPatch.context() as mp:
        _point_at(mp, server.url, root)
        result = export_folder(
            source, root / "out" / "cait_xxs24_224_ls.fb_dist_in1k", push_to_hub="my-org/cait_xxs24_224_ls.fb_dist_in1k"
        )
    yield result, reference, server, source


@pytest.mark.compat
def test_export_writes_a_folder_timm_loads_bit_exactly(exported) -> None:
    import timm

    import timm_layerscale  # noqa: F401  (registers the models)

    result, reference, _, _ = exported
    model = timm.create_model(f"local-dir:{result.folder}", pretrained=True).eval()
    assert type(model).__name__ == "CaitLS"
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.full
def test_a_pushed_folder_loads_from_the_hub_as_its_card_and_summary_say(
    exported, hub: FakeHub, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Pushed to the Hub (a local stand-in), the folder loads with the model card's two Python
    examples as written, and, pushed to main, a branch or a pull request, with the
    ``create_model`` call the summary prints and in transformers at that revision, each with
    the reference's outputs."""
    import timm
    from PIL import Image
    from transformers import AutoModelForImageClassification

    _endpoint_read_on_import(monkeypatch, hub.url)
    result, reference, _, _ = exported
    card = (result.folder / "README.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert len(examples) == 2 and all(result.repo_id in e for e in examples), card
    push_folder(result.folder, result.repo_id)
    monkeypatch.chdir(tmp_path)
    pixels = torch.randint(0, 256, (256, 320, 3), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save("image.jpg")
    with_timm: dict[str, Any] = {}
    exec(compile(examples[0], "README.md", "exec"), with_timm)
    with torch.inference_mode():
        expected = reference(with_timm["transform"](Image.open("image.jpg").convert("RGB")).unsqueeze(0))
    assert torch.equal(with_timm["probs"], expected.softmax(dim=-1))
    with_transformers: dict[str, Any] = {}
    exec(compile(examples[1], "README.md", "exec"), with_transformers)
    top = with_transformers["classify"]("image.jpg", top_k=1)[0]
    assert top["label"] == with_transformers["classify"].model.config.id2label[int(expected.argmax())]
    printed = capsys.readouterr().out  # what each example prints
    assert "tensor([[" in printed and repr(top["label"]) in printed

    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = reference(x)
    pushes: list[dict[str, Any]] = [{}, {"revision": "v2"}, {"create_pr": True}]
    for i, kwargs in enumerate(pushes):
        res = push_folder(result.folder, f"my-org/cait-{i}", **kwargs)
        call = re.search(r'timm\.create_model\("(hf-hub:[^"]+)", pretrained=True\)', res.summary())
        assert call is not None, res.summary()
        model = timm.create_model(call.group(1), pretrained=True).eval()
        revision = call.group(1).partition("@")[2] or None
        hf = AutoModelForImageClassification.from_pretrained(f"my-org/cait-{i}", revision=revision).eval()
        with torch.inference_mode():
            assert torch.equal(model(x), expected), kwargs
            assert torch.equal(hf(pixel_values=x).logits, expected), kwargs


def test_verify_reads_an_exported_folder_as_the_converted_weights(exported) -> None:
    """``verify SOURCE FOLDER`` as a user runs it (a fresh process): the folder's weights are the converted file."""
    result, _, _, source = exported
    argv = ["-m", "timm_layerscale", "verify", str(source), str(result.folder), "--num-inputs", "1", "--json"]
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["bit_exact"] and report["weights_equal"] and report["weights_compared"] > 0


def test_export_files_config_and_metadata(exported) -> None:
    from safetensors import safe_open

    result, _, _, source = exported
    names = sorted(p.name for p in result.folder.iterdir())
    assert names == ["README.md", "config.json", "gates.png", "model.safetensors"] or (
        result.plot is None and names == ["README.md", "config.json", "model.safetensors"]
    )
    with safe_open(str(result.folder / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert any(k.endswith("ls1.gamma") for k in f.keys())  # noqa: SIM118  (safe_open has no __iter__)
        assert not any("gamma_1" in k for k in f.keys())  # noqa: SIM118
    assert meta["format"] == "pt"
    assert meta["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert meta["architecture"] == "cait_xxs24_224_ls"
    config = json.loads((result.folder / "config.json").read_text())
    assert config["architecture"] == "cait_xxs24_224_ls"
    assert config["num_classes"] == 1000 and config["num_features"] == 192
    pcfg = config["pretrained_cfg"]
    assert pcfg["input_size"] == [3, 224, 224]
    assert pcfg["crop_pct"] == 1.0 and pcfg["interpolation"] == "bicubic"
    assert pcfg["mean"] == pytest.approx([0.485, 0.456, 0.406]) and pcfg["std"] == pytest.approx([0.229, 0.224, 0.225])
    assert not list(result.folder.parent.glob(".*tmp*"))


def test_export_model_card(exported) -> None:
    from huggingface_hub import ModelCard

    result, _, _, source = exported
    card = ModelCard.load(result.folder / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "timm"
    assert data["license"] == "apache-2.0"
    assert {"image-classification", "timm", "layerscale"} <= set(data["tags"])
    assert data["datasets"] == ["imagenet-1k"]
    text = card.text
    sha = result.conversion.source_sha256
    assert sha in text and "XXS24_224.pth" in text
    # The command by file names, as the source line and the weights' metadata: no local folder is published.
    assert "timm-layerscale export XXS24_224.pth cait_xxs24_224_ls.fb_dist_in1k --push-to-hub my-org/" in text
    assert str(source.parent) not in text
    assert "| max abs diff | 0 |" in text and "| bit-exact | yes |" in text and "top-1 agreement" in text
    assert "`blocks.N.gamma_1` | `blocks.N.ls1.gamma`" in text
    usage = text.index("import timm_layerscale")
    assert usage < text.index('timm.create_model("hf-hub:my-org/cait_xxs24_224_ls.fb_dist_in1k"')
    assert "Going Deeper With Image Transformers" in text and "@inproceedings{touvron2021cait," in text
    if result.plot is not None:
        assert "](gates.png)" in text
    assert "`timm-layerscale inspect hf-hub:my-org/cait_xxs24_224_ls.fb_dist_in1k` prints the full table." in text


@pytest.mark.full
def test_a_card_publishes_no_credentials_of_a_source_url(exported, tmp_path: Path, monkeypatch, capsys) -> None:
    """A presigned URL's query, or a user name and password in it, stay out of the card and the summary."""
    from timm_layerscale.files.read import cached_url_path

    _, _, _, source = exported
    url = "https://alice:hunter2@storage.example:8443/runs/XXS24_224.pth?X-Amz-Signature=s3cr3t&token=t0k3n#part"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    cached = cached_url_path(url)  # downloaded before: the export reads it from the cache
    cached.parent.mkdir(parents=True)
    shutil.copyfile(source, cached)
    res = export_folder(url, tmp_path / "out", options=VerifyOptions(num_inputs=1), plot=False)
    text = (res.folder / "README.md").read_text()
    assert res.conversion.source == "https://storage.example:8443/runs/XXS24_224.pth"
    assert "[XXS24_224.pth](https://storage.example:8443/runs/XXS24_224.pth)" in text
    assert "timm-layerscale export https://storage.example:8443/runs/XXS24_224.pth " in text
    code, out, _ = cli(capsys, "convert", url, tmp_path / "x.safetensors", "--num-inputs", "1")
    assert code == 0 and "converted https://storage.example:8443/runs/XXS24_224.pth (official layout)" in out
    shown = (text, res.summary(), json.dumps(res.to_dict()), out)  # and what the command line prints
    assert not any(secret in t for t in shown for secret in ("alice", "hunter2", "s3cr3t", "t0k3n", "#part"))


def test_export_pushed_the_folder(exported) -> None:
    result, _, server, _ = exported
    assert result.push is not None and not result.push.dry_run
    assert len(server.commits) == 1
    committed = server.commits[0]["files"]
    assert committed == {p.name: p.read_bytes() for p in result.folder.iterdir()}
    assert "my-org/cait_xxs24_224_ls.fb_dist_in1k" in result.summary()


def test_export_refuses_a_non_empty_folder(exported, tmp_path: Path) -> None:
    result, _, _, source = exported
    with pytest.raises(OutputExistsError, match="pass overwrite=True"):
        export_folder(source, result.folder)


def test_export_refuses_nan_or_inf_without_the_advice_convert_gives(official, tmp_path: Path, capsys) -> None:
    """convert lets NaN or Inf through on request; a published folder never holds them, and
    export has no such option to suggest."""
    ckpt = torch.load(official, weights_only=True)
    ckpt["model"]["module.blocks.5.attn.proj.weight"][0, 0] = float("inf")
    src = tmp_path / "inf.pth"
    torch.save(ckpt, src)
    line = assert_one_line_error(*cli(capsys, "export", src, tmp_path / "out"), stdout="")
    assert line.endswith(
        f"{src}: 1 tensor(s) contain NaN or Inf, first 'blocks.5.attn.proj.weight'; "
        "a published model must be finite, check the source checkpoint"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inf.pth"]


def test_export_says_a_damaged_file_is_corrupt_before_what_its_values_hold(official, tmp_path: Path, capsys) -> None:
    """Bytes overwritten inside a tensor can read as NaN; the file's checksums name the cause."""
    weight = torch.load(official, weights_only=True)["model"]["module.blocks.5.attn.proj.weight"]
    shutil.copy(official, src := tmp_path / "XXS24_224.pth")
    damage_inside(src, weight, 64, fill=b"\xff")  # NaN bit patterns
    assert torch.load(src, weights_only=True)["model"]["module.blocks.5.attn.proj.weight"].isnan().any()
    line = assert_one_line_error(*cli(capsys, "export", src, tmp_path / "out"), stdout="")
    assert f"{src} is corrupt (Bad CRC-32 for file" in line and line.endswith("; download it again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["XXS24_224.pth"]


@pytest.mark.parametrize("option", ["push_to_hub", "repo_id"])
def test_export_rejects_a_bad_hub_id_before_converting(tmp_path: Path, option: str) -> None:
    bad: dict[str, Any] = {option: "not a/repo id"}
    with pytest.raises(HubError, match="ORG/NAME"):
        export_folder(tmp_path / "missing.pth", tmp_path / "out", **bad)
    assert not (tmp_path / "out").exists()


def test_failed_export_leaves_nothing_behind(tmp_path: Path) -> None:
    from timm_layerscale.errors import CheckpointError

    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"PK\x03\x04 not really a zip file")
    with pytest.raises(CheckpointError, match="could not be read"):
        export_folder(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pth"]


def test_model_card_without_plot_or_reference(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from huggingface_hub import ModelCard

    from timm_layerscale.families import get_variant
    from timm_layerscale.hub.card import build_model_card

    conversion = SimpleNamespace(
        variant=get_variant("cait_s24_224_ls"),
        source="https://dl.fbaipublicfiles.com/deit/S24_224.pth",
        source_path=tmp_path / "S24_224.pth",
        source_sha256="ab" * 32,
        source_layout="official",
        target_layout="ls",
        renamed=[("blocks.N.gamma_1", "blocks.N.ls1.gamma")],
        changed="",
        report=None,
    )
    config = {
        "architecture": "cait_s24_224_ls",
        "num_classes": 1000,
        "pretrained_cfg": {"input_size": [3, 224, 224], "tag": "fb_dist_in1k"},
    }
    card = build_model_card(
        conversion, repo_id="org/x", config=config, num_params=46_900_000, command="timm-layerscale export a b"
    )
    text = str(card)
    assert ModelCard(text).data.to_dict()["license"] == "apache-2.0"
    assert "[S24_224.pth](https://dl.fbaipublicfiles.com/deit/S24_224.pth)" in text
    assert "no output comparison was made" in text
    assert "| `blocks.N.gamma_1` | `blocks.N.ls1.gamma` |" in text and "`{'model': {'module.' + key: tensor}}`" in text
    assert "gates.png" not in text and "## LayerScale gates" not in text
    assert "**Params (M):** 46.9" in text
    assert ModelCard(text).data.to_dict()["datasets"] == ["imagenet-1k"] and "**Dataset:** imagenet-1k" in text
    # a fine-tuned head of other classes than the tag's weights claims none of its data; a backbone keeps it
    for classes, datasets in ((10, None), (0, ["imagenet-1k"])):
        text = str(
            build_model_card(
                conversion, repo_id="org/x", config={**config, "num_classes": classes}, num_params=1, command="c"
            )
        )
        assert ModelCard(text).data.to_dict().get("datasets") == datasets and ("**Dataset:**" in text) == bool(datasets)


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize(
    ("text", "descriptions"),
    [
        (b"tench\tTinca tinca\ngoldfish\n", {"tench": "Tinca tinca"}),
        (BOM + b"tench\tTinca tinca\r\ngoldfish\r\n", {"tench": "Tinca tinca"}),
        (BOM + b'["tench", "goldfish"]', None),
        (b'{"1": "goldfish", "0": "tench"}', None),
    ],
    ids=["lines", "windows lines", "windows json", "id2label"],
)
def test_label_files_as_editors_save_them(tmp_path: Path, text: bytes, descriptions: dict | None) -> None:
    """A Windows editor's byte-order mark and CRLF line ends do not reach the class names."""
    from timm_layerscale.hub.config import read_label_names

    path = tmp_path / "labels.txt"
    path.write_bytes(text)
    assert read_label_names(path) == (["tench", "goldfish"], descriptions)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, r"cannot read the label file .*missing.txt \(No such file or directory\); pass a UTF-8 text file"),
        (b"", r"labels.txt holds no class names; write one name per class$"),
        (b"cat\n\ndog\n", r"labels.txt holds no name for class 1; write one name per class$"),
        (b"\xff\xfe", r"cannot read the label file .*labels.txt \(.*\); pass a UTF-8 text file, one name per line$"),
        (
            b'["tench",',
            r"labels.txt is not valid JSON \(Expecting value at line 1\); fix it or write one name per line$",
        ),
        (b'["tench", 2]', r"labels.txt holds 2, not a name; give one string per class$"),
        (b'{"0": "tench", "1": null}', r"labels.txt holds None, not a name; give one string per class$"),
        (
            b'{"1": "goldfish", "2": "tench"}',
            r"labels.txt is neither a list of names nor an object from every class index to a name;"
            r" write \[\"tench\", \.\.\.\] or \{\"0\": \"tench\", \.\.\.\}$",
        ),
    ],
    ids=["missing", "empty", "gap", "not utf-8", "bad json", "not strings", "null", "not every index"],
)
def test_label_file_errors_say_what_to_write(tmp_path: Path, text: bytes | None, message: str) -> None:
    from timm_layerscale.errors import CheckpointError
    from timm_layerscale.hub.config import read_label_names

    path = tmp_path / ("missing.txt" if text is None else "labels.txt")
    if text is not None:
        path.write_bytes(text)
    with pytest.raises(CheckpointError, match=message):
        read_label_names(path)


def test_label_names_from_python_are_checked_before_anything_is_written(official, tmp_path: Path) -> None:
    from timm_layerscale.errors import CheckpointError

    cases: list[tuple[Any, str]] = [
        ({0: "tench", 1: "goldfish"}, r"label_names holds 0, not a name; give one string per class$"),
        (["tench", "tench"], r"label_names names a class twice \('tench'\); class names must be unique$"),
    ]
    for names, message in cases:
        with pytest.raises(CheckpointError, match=message):
            export_folder(official, tmp_path / "out", label_names=names, plot=False)
    assert list(tmp_path.iterdir()) == []
