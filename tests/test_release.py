"""Tests for the CaiT release pipeline (convert/), offline.

The pipeline runs over a folder of synthetic checkpoints in the official layout
(``{'model': {'module.' + key: tensor}}``, seeded random weights): two good ones, a
corrupt one between them and one missing, and uploads to the loopback Hub of
``test_hub``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from convert.release_cait import RELEASES, PipelineError, format_markdown, main, select
from test_hub import FakeHub, _point_at

ONLY = ["cait_xxs24_224", "XXS24_384", "cait_xxs36_224_ls", "xs24_384"]


def test_table_holds_the_ten_official_checkpoints() -> None:
    import timm

    from timm_layerscale.models import cait_ls

    assert len(RELEASES) == 10
    assert [r.model for r in RELEASES] == list(cait_ls.VARIANTS)
    for r in RELEASES:
        assert timm.is_model(r.model) and timm.is_model(r.reference)
        assert r.url == f"https://dl.fbaipublicfiles.com/deit/{r.file}"
        reference_cfg = timm.models.get_pretrained_cfg(f"{r.reference}.fb_dist_in1k")
        our_cfg = timm.models.get_pretrained_cfg(f"{r.model}.fb_dist_in1k")
        assert reference_cfg is not None and reference_cfg.hf_hub_id == r.timm_hub_id
        assert our_cfg is not None and our_cfg.url == r.url
        assert r.name == f"{r.model}.fb_dist_in1k"
        assert r.sha256 is None  # not published upstream; see the comment on PINNED_SHA256


def test_select_by_any_name_in_table_order() -> None:
    picked = select(["S24_224", "cait_xxs24_224_LS", "cait_m48_448", "xxs36_384.pth"])
    assert [r.reference for r in picked] == ["cait_xxs24_224", "cait_xxs36_384", "cait_s24_224", "cait_m48_448"]
    assert select(None) == list(RELEASES)
    with pytest.raises(PipelineError, match="unknown variant"):
        select(["cait_s24_225"])


def test_bad_arguments_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown variant(s) nope" in capsys.readouterr().err
    assert main(["--sources", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_list_prints_the_table(capsys) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(r.url in out and r.timm_hub_id in out for r in RELEASES)


def test_markdown_summary_format() -> None:
    rows: list[dict[str, Any]] = [
        {
            "variant": "cait_xxs24_224_ls",
            "params": 11_956_264,
            "source_sha256": "ab" * 32,
            "max_abs_diff": 0.0,
            "bit_exact": True,
            "seconds": 12.345,
            "peak_memory_mib": 812.4,
            "status": "ok",
            "error": None,
        },
        {
            "variant": "cait_s24_224_ls",
            "params": None,
            "source_sha256": None,
            "max_abs_diff": None,
            "bit_exact": None,
            "seconds": 0.1,
            "peak_memory_mib": 300.0,
            "status": "failed",
            "error": "boom; retry",
        },
    ]
    md = format_markdown(rows)
    assert (
        "| variant | params (M) | source sha256 | max abs diff | bit-exact | seconds | peak memory (MiB) | status |"
        in md
    )
    assert f"| `cait_xxs24_224_ls` | 12.0 | `{'ab' * 32}` | 0 | yes | 12.3 | 812.4 | ok |" in md
    assert "| `cait_s24_224_ls` | - | - | - | - | 0.1 | 300.0 | failed |" in md
    assert "- `cait_s24_224_ls`: boom; retry" in md


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    from timm_layerscale.demo import write_official_checkpoint

    root = tmp_path_factory.mktemp("release")
    sources = root / "sources"
    sources.mkdir()
    write_official_checkpoint(sources / "XXS24_224.pth", "cait_xxs24_224", seed=0)
    write_official_checkpoint(sources / "XXS36_224.pth", "cait_xxs36_224", seed=1)
    good = (sources / "XXS24_224.pth").read_bytes()
    (sources / "XXS24_384.pth").write_bytes(good[: len(good) // 3])  # truncated download
    out = root / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        _point_at(mp, hub.url, root)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["--sources", str(sources), "--out", str(out), "--org", "my-org", "--only", *ONLY])
    return code, out, sources, hub, stdout.getvalue(), stderr.getvalue()


def test_pipeline_runs_on_after_a_failure_and_exits_1(pipeline) -> None:
    code, out, _, _, stdout, stderr = pipeline
    assert code == 1
    data = json.loads((out / "summary.json").read_text())
    rows = data["results"]
    assert [r["variant"] for r in rows] == [
        "cait_xxs24_224_ls",
        "cait_xxs24_384_ls",
        "cait_xxs36_224_ls",
        "cait_xs24_384_ls",
    ]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "failed"]
    assert data["failed"] == ["cait_xxs24_384_ls", "cait_xs24_384_ls"]
    assert "XXS24_384.pth" in rows[1]["error"]
    assert "XS24_384.pth is not in" in rows[3]["error"]
    assert "2 of 4 variant(s) failed" in stderr
    assert "cait_xxs24_384" in stderr and "cait_xs24_384" in stderr
    assert "summary written to" in stdout


def test_pipeline_summary_rows(pipeline) -> None:
    from timm_layerscale.conversion.io import sha256_file

    _, out, sources, _, _, _ = pipeline
    rows = {r["variant"]: r for r in json.loads((out / "summary.json").read_text())["results"]}
    for name, file, params in (
        ("cait_xxs24_224_ls", "XXS24_224.pth", 12.0e6),
        ("cait_xxs36_224_ls", "XXS36_224.pth", 17.3e6),
    ):
        r = rows[name]
        assert r["source_sha256"] == sha256_file(sources / file)
        assert r["bit_exact"] is True and r["max_abs_diff"] == 0.0
        assert r["params"] == pytest.approx(params, rel=0.01)
        assert r["seconds"] > 0 and r["peak_memory_mib"] > 0
        assert Path(r["folder"]) == out / f"{name}.fb_dist_in1k"
    md = (out / "summary.md").read_text()
    assert "| `cait_xxs24_224_ls` | 12.0 |" in md and "## Failures" in md
    assert "[my-org/cait_xxs24_224_ls.fb_dist_in1k](" in md


def test_pipeline_exports_and_pushes_only_the_good_variants(pipeline) -> None:
    _, out, sources, hub, _, _ = pipeline
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == ["cait_xxs24_224_ls.fb_dist_in1k", "cait_xxs36_224_ls.fb_dist_in1k"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert sorted(c["repo_id"] for c in hub.commits) == [f"my-org/{f}" for f in folders]
    for folder in folders:
        config = json.loads((out / folder / "config.json").read_text())
        assert config["architecture"] == folder.split(".")[0]
        card = (out / folder / "README.md").read_text()
        assert "python -m convert --only" in card and f"--sources {sources}" in card
        assert f"hf-hub:my-org/{folder}" in card
