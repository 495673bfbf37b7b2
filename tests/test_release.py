"""Tests for the release pipeline of every family (convert/), offline."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from convert.release import PipelineError, main, releases, select
from test_hub import FakeHub, _point_at

pytestmark = pytest.mark.full  # make test leaves this file to make test-full

ONLY = [
    "cait_xxs24_224",
    "XXS24_384",
    "cait_xxs36_224_ls",
    "xs24_384",
    "deit_3_small_224_21k.pth",
    "vit5_small_patch16_224.in1k_ema",
]


def test_table_holds_every_official_release_of_each_family() -> None:
    import timm

    from timm_layerscale.models import cait_ls

    table = releases()
    by_family = {f: [r for r in table if r.family == f] for f in ("cait", "deit3", "vit5")}
    assert [r.model for r in by_family["cait"]] == list(cait_ls.VARIANTS)
    assert len(by_family["deit3"]) == 16 and len(by_family["vit5"]) == 10 and len(table) == 40
    pe = [r.source for r in table if r.family == "pe"]
    assert pe[0] == "hf-hub:facebook/PE-Lang-L14-448/PE-Lang-L14-448.pt" and len(pe) == 3
    (intern,) = (r for r in table if r.family == "internvit")
    assert intern.source.endswith("InternViT-300M-448px-V2_5/model.safetensors") and intern.reference
    assert intern.timm_hub_id == "timm/vit_intern300m_patch14_448.ogvl_dist"
    for r in by_family["cait"]:
        assert r.reference is not None and timm.is_model(r.model) and timm.is_model(r.reference)
        assert r.source == f"https://dl.fbaipublicfiles.com/deit/{r.file}" and r.tag == "fb_dist_in1k"
        our_cfg = timm.models.get_pretrained_cfg(f"{r.model}.fb_dist_in1k")
        assert our_cfg is not None and our_cfg.url == r.source
    for r in by_family["cait"] + by_family["deit3"]:
        reference_cfg = timm.models.get_pretrained_cfg(f"{r.reference}.{r.tag}")
        assert reference_cfg is not None and reference_cfg.hf_hub_id == r.timm_hub_id
    for r in by_family["deit3"]:
        assert r.model == r.reference and r.source.startswith("https://dl.fbaipublicfiles.com/deit/deit_3_")
    for r in by_family["vit5"]:
        assert r.source == f"hf-hub:FengWang3211/ViT-5/{r.model}.pth" and r.timm_hub_id is None
        assert r.ema == (r.tag == "in1k_ema")
    assert len({r.name for r in table}) == len(table)


def test_select_by_any_name_in_table_order() -> None:
    picked = select(["S24_224", "cait_xxs24_224_LS", "cait_m48_448", "xxs36_384.pth"])
    assert [r.reference for r in picked] == ["cait_xxs24_224", "cait_xxs36_384", "cait_s24_224", "cait_m48_448"]
    assert [r.name for r in select(["deit3_small_patch16_224"])] == [
        "deit3_small_patch16_224.fb_in1k",
        "deit3_small_patch16_224.fb_in22k_ft_in1k",
    ]
    assert [r.name for r in select(["vit5_base_patch16_384.in1k"])] == ["vit5_base_patch16_384.in1k"]
    assert select(None) == list(releases())
    assert {r.family for r in select(None, ["deit3"])} == {"deit3"}
    with pytest.raises(PipelineError, match="unknown variant"):
        select(["cait_s24_225"])
    with pytest.raises(PipelineError, match="unknown variant"):
        select(["cait_s24_224"], ["vit5"])


def test_bad_arguments_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown variant(s) nope" in capsys.readouterr().err
    assert main(["--sources", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_pipeline_says_so_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    from convert import release

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(release, "run_release", stopped)
    sources = tmp_path / "sources"
    sources.mkdir()
    assert main(["--only", "cait_xxs24_224", "--sources", str(sources), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "python -m convert: error: interrupted"


def test_list_prints_the_plan_offline(capsys) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(r.source in out and r.name in out and (r.timm_hub_id or "-") in out for r in releases())
    assert main(["--list", "--family", "vit5"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 10 and all(line.startswith("vit5_") for line in lines)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    from timm_layerscale.demo import write_official_checkpoint

    root = tmp_path_factory.mktemp("release")
    sources = root / "sources"
    sources.mkdir()
    write_official_checkpoint(sources / "XXS24_224.pth", "cait_xxs24_224", seed=0)
    write_official_checkpoint(sources / "XXS36_224.pth", "cait_xxs36_224", seed=1)
    write_official_checkpoint(sources / "deit_3_small_224_21k.pth", "deit3_small_patch16_224", seed=2)
    write_official_checkpoint(sources / "vit5_small_patch16_224.pth", "vit5_small_patch16_224", seed=3)
    vit5 = torch.load(sources / "vit5_small_patch16_224.pth", weights_only=True)
    vit5["model_ema"] = {k: v if k.endswith(".freqs") else v + 0.01 for k, v in vit5["model"].items()}
    torch.save(vit5, sources / "vit5_small_patch16_224.pth")
    good = (sources / "XXS24_224.pth").read_bytes()
    (sources / "XXS24_384.pth").write_bytes(good[: len(good) // 3])  # truncated download
    out = root / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        _point_at(mp, hub.url, root)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(
                ["--sources", str(sources), "--out", str(out), "--org", "my-org", "--num-inputs", "1", "--only", *ONLY]
            )
    return code, out, sources, hub, stdout.getvalue(), stderr.getvalue()


def test_pipeline_runs_on_after_a_failure_and_exits_1(pipeline) -> None:
    code, out, _, _, stdout, stderr = pipeline
    assert code == 1
    data = json.loads((out / "summary.json").read_text())
    rows = data["results"]
    assert [f"{r['variant']}.{r['tag']}" for r in rows] == [
        "cait_xxs24_224_ls.fb_dist_in1k",
        "cait_xxs24_384_ls.fb_dist_in1k",
        "cait_xxs36_224_ls.fb_dist_in1k",
        "cait_xs24_384_ls.fb_dist_in1k",
        "vit5_small_patch16_224.in1k_ema",
        "deit3_small_patch16_224.fb_in22k_ft_in1k",
    ]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "failed", "ok", "ok"]
    assert data["failed"] == ["cait_xxs24_384_ls.fb_dist_in1k", "cait_xs24_384_ls.fb_dist_in1k"]
    assert "XXS24_384.pth" in rows[1]["error"]
    assert "XS24_384.pth is not in" in rows[3]["error"]
    assert "2 of 6 release(s) failed" in stderr
    assert "cait_xxs24_384_ls.fb_dist_in1k" in stderr and "cait_xs24_384_ls.fb_dist_in1k" in stderr
    assert "summary written to" in stdout
    assert "cait_xxs24_224_ls.fb_dist_in1k: ok (" in stderr
    assert "model/s" not in stderr  # no progress bar where stderr is not a terminal


def test_pipeline_summary_rows(pipeline) -> None:
    _, out, sources, _, _, _ = pipeline
    rows = {f"{r['variant']}.{r['tag']}": r for r in json.loads((out / "summary.json").read_text())["results"]}
    for name, file, params, exact in (
        ("cait_xxs24_224_ls.fb_dist_in1k", "XXS24_224.pth", 12.0e6, True),
        ("cait_xxs36_224_ls.fb_dist_in1k", "XXS36_224.pth", 17.3e6, True),
        ("deit3_small_patch16_224.fb_in22k_ft_in1k", "deit_3_small_224_21k.pth", 22.1e6, True),
        ("vit5_small_patch16_224.in1k_ema", "vit5_small_patch16_224.pth", 22.0e6, None),  # within tolerance
    ):
        r = rows[name]
        assert r["source_sha256"] == hashlib.sha256((sources / file).read_bytes()).hexdigest()
        if exact:
            assert r["bit_exact"] is True and r["max_abs_diff"] == 0.0
        assert r["params"] == pytest.approx(params, rel=0.01)
        assert r["seconds"] > 0
        assert Path(r["folder"]) == out / name
    md = (out / "summary.md").read_text()
    assert "| `cait_xxs24_224_ls.fb_dist_in1k` | 12.0 |" in md and "## Failures" in md
    assert "[my-org/cait_xxs24_224_ls.fb_dist_in1k](" in md


def test_pipeline_exports_and_pushes_only_the_good_variants(pipeline) -> None:
    _, out, sources, hub, _, _ = pipeline
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == [
        "cait_xxs24_224_ls.fb_dist_in1k",
        "cait_xxs36_224_ls.fb_dist_in1k",
        "deit3_small_patch16_224.fb_in22k_ft_in1k",
        "vit5_small_patch16_224.in1k_ema",
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert sorted(c["repo_id"] for c in hub.commits) == [f"my-org/{f}" for f in folders]
    for folder in folders:
        config = json.loads((out / folder / "config.json").read_text())
        assert [config["architecture"], config["pretrained_cfg"]["tag"]] == folder.split(".")
        card = (out / folder / "README.md").read_text()
        assert f"--out {out.name} --sources sources --org my-org" in card  # local folders by name
        assert str(sources.parent) not in card
        assert f"hf-hub:my-org/{folder}" in card


def test_pipeline_takes_the_ema_weights_for_an_ema_release(pipeline) -> None:
    from safetensors.torch import load_file

    _, out, sources, _, _, _ = pipeline
    ema = torch.load(sources / "vit5_small_patch16_224.pth", weights_only=True)["model_ema"]
    exported = load_file(out / "vit5_small_patch16_224.in1k_ema" / "model.safetensors")
    assert torch.equal(exported["blocks.0.ls1.gamma"], ema["blocks.0.gamma_1"])
