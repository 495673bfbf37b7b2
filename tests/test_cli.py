"""The ``timm-layerscale`` command line: subcommands, exit codes, and every bad input."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch
import torch

import timm_layerscale  # registers the models
from helpers import ERROR, ROOT, assert_one_line_error, cli, damage_inside, parity_report, run_python_into
from timm_layerscale import cli as commands
from timm_layerscale import converter as conversion
from timm_layerscale import progress
from timm_layerscale.cli import main
from timm_layerscale.conversion.detect import state_dict_shapes
from timm_layerscale.conversion.rules import to_gamma
from timm_layerscale.converter import convert_checkpoint
from timm_layerscale.errors import CheckpointError, ParityError, option
from timm_layerscale.families import get_variant

MODEL = "cait_xxs24_224_ls"
REFERENCE = "cait_xxs24_224"

pytestmark = pytest.mark.usefixtures("few_inputs")  # one seeded image: these tests do not count them


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli-converted") / f"{MODEL}.safetensors"
    convert_checkpoint(official, out, verify=False)
    return out


@pytest.fixture(scope="module")
def light_sd() -> dict[str, torch.Tensor]:
    """Official-layout keys and shapes of cait_xxs24_224 with tiny storage (rows broadcast)."""
    gen = torch.Generator().manual_seed(0)
    shapes = to_gamma(state_dict_shapes(get_variant(MODEL)), "cait")
    return {"module." + k: torch.randn(s[-1], generator=gen).expand(s) for k, s in shapes.items()}


def folder_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _python(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, **kw)


_NO_TORCH = """
import contextlib, io, json, runpy, sys
results = {}
BAD = (["verify", "a.pth", "b.safetensors", "--num-inputs", "-1"], ["verify", "a", "b", "--atol", "-1"],
       ["convert", "a", "b", "--rtol", "nan"], ["verify", "a", "b", "--num-inputs", "many"],
       ["export", "a", "b", "--num-inputs", "0"], ["verify", "a", "b", "--batch-size", "0"],
       ["verify", "a", "b", "--seed", str(2**64)], ["verify", "a", "b", "--seed", "1.5"])
for argv in (["--help"], ["convert", "--help"], ["convert", "only-one-arg"], ["--version"], *BAD):
    sys.argv = ["timm-layerscale", *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("timm_layerscale", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    results[" ".join(argv[-2:] if argv in BAD else argv)] = [code, out.getvalue(), err.getvalue()]
results["torch imported"] = "torch" in sys.modules
print(json.dumps(results))
"""


def test_help_and_argument_errors_are_one_line_without_importing_torch():
    proc = _python("-c", _NO_TORCH)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    code, out, _ = res["--help"]
    assert code == 0 and "examples:" in out
    code, out, _ = res["convert --help"]
    assert code == 0 and "SOURCE" in out and "--overwrite" in out and "--no-verify" in out
    code, out, err = res["convert only-one-arg"]
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "error:" in err and "OUTPUT" in err
    assert res["--version"] == [0, f"timm-layerscale {timm_layerscale.__version__}\n", ""]
    assert res["torch imported"] is False, "--help and argument errors must not import torch"
    expected = {
        "--num-inputs -1": "argument --num-inputs: expected a whole number >= 0, got '-1'",
        "--atol -1": "argument --atol: expected a number >= 0, got '-1'",
        "--rtol nan": "argument --rtol: expected a number >= 0, got 'nan'",
        "--num-inputs many": "argument --num-inputs: expected a whole number >= 0, got 'many'",
        "--num-inputs 0": "argument --num-inputs: 0 leaves no inputs; pass --images FILE ... too",
        "--batch-size 0": "argument --batch-size: expected a whole number >= 1, got '0'",
        f"--seed {2**64}": f"argument --seed: expected a seed from -2**63 to 2**64 - 1, got '{2**64}'",
        "--seed 1.5": "argument --seed: expected a seed from -2**63 to 2**64 - 1, got '1.5'",
    }
    for key, text in expected.items():
        code, _, err = res[key]
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(ERROR) and text in err, (key, err)


def test_argument_errors_exit_2(capsys):
    for argv in (["convert"], ["convert", "a", "b", "--to", "nope"], ["verify", "a"], ["bogus"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and "error:" in err
    assert main([]) == 2
    assert "examples:" in capsys.readouterr().err
    for argv in (["list", "nope"], ["--bogus"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().err.endswith(f"unrecognized arguments: {argv[-1]} (see 'timm-layerscale --help')\n")


def test_convert_prints_the_parity_table(official, tmp_path, capsys):
    out = tmp_path / "xxs24.safetensors"
    code, stdout, err = cli(capsys, "convert", official, out)
    assert code == 0, err
    assert err == ""
    assert f"as {MODEL}" in stdout and "(official layout)" in stdout and "(ls layout)" in stdout
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in stdout.splitlines()[1:] if "  " in line}
    assert rows["bit-exact"] == "yes" and rows["result"] == "PASS (bit-exact)"
    assert rows["weights"].endswith("tensors of the converted file equal to the source's")
    assert rows["reference"] == REFERENCE and rows["converted"] == MODEL
    assert folder_names(tmp_path) == ["xxs24.safetensors"]


def test_convert_json(official, tmp_path, capsys):
    out = tmp_path / "xxs24.safetensors"
    code, stdout, err = cli(capsys, "convert", official, out, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["ok"] is True and res["model"] == MODEL and res["output"] == str(out)
    assert res["source_sha256"] == hashlib.sha256(official.read_bytes()).hexdigest()
    assert (res["source_layout"], res["target_layout"]) == ("official", "ls")
    assert res["metadata"]["format"] == "pt" and res["metadata"]["architecture"] == MODEL
    rep = res["report"]
    assert rep["bit_exact"] is True and rep["passed"] is True and rep["max_abs_diff"] == 0
    assert {"max_rel_diff", "cosine_min", "top1_agreement", "top5_agreement", "dtype", "attention"} <= set(rep)
    # each phase's wall seconds, together within the conversion's; the models' as the report has them
    phases = res["phases"]
    assert list(phases) == ["read", "rules", "reference", "converted model", "write", "weight check"], phases
    assert all(t >= 0 for t in phases.values()) and sum(phases.values()) <= res["seconds"] + 0.01
    assert rep["seconds"] == {k: phases[k] for k in ("reference", "converted model")} and phases["reference"] > 0

    code, stdout, _ = cli(capsys, "convert", out, tmp_path / "g.pth", "--to", "gamma", "--no-verify", "--json")
    res = json.loads(stdout)
    assert code == 0 and res["report"] is None and res["target_layout"] == "official"
    assert list(res["phases"]) == ["read", "rules", "write"]
    assert res["note"] == "'gamma' is a word of one release: wrote CaiT's official layout; pass --to official"
    assert res["container"] == "{'model': {'module.' + key: tensor}}"
    assert "ls1.gamma" not in str(list(torch.load(tmp_path / "g.pth", weights_only=True)["model"]))


@pytest.mark.full
def test_convert_fold_then_verify_and_load_the_folded_file(official, tmp_path, capsys):
    import timm

    folded = tmp_path / "folded.safetensors"
    code, out, err = cli(capsys, "convert", official, folded, "--fold", "--num-inputs", "2")
    assert code == 0, err
    assert f"-> {folded} (ls layout, LayerScale folded into the weights)" in out
    assert any(line.split() == ["result", "PASS", "(within", "tolerance)"] for line in out.splitlines()), out
    with safetensors.safe_open(str(folded), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["folded_layerscale"] == "true" and meta["parity"] == "within tolerance"
    assert not any(k.endswith(".gamma") for k in keys)

    code, out, err = cli(capsys, "verify", official, folded, "--num-inputs", "2")
    assert code == 0, err
    assert f"{MODEL} (folded_layerscale)" in out and "LayerScale folded into the weights" in out
    model = timm.create_model(
        MODEL, pretrained=True, folded_layerscale=True, pretrained_cfg_overlay=dict(file=str(folded))
    )
    assert all(torch.equal(v, safetensors.torch.load_file(str(folded))[k]) for k, v in model.state_dict().items())

    assert_one_line_error(*cli(capsys, "convert", folded, tmp_path / "again.safetensors"), "folded")
    assert_one_line_error(
        *cli(capsys, "convert", official, tmp_path / "g.pth", "--fold", "--to", "gamma"),
        "ls layout only; leave out --to gamma or --fold",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folded.safetensors"]


@pytest.mark.parametrize("name", ["out.txt"])
def test_convert_refuses_an_output_suffix_that_names_no_format(light_sd, tmp_path, capsys, name):
    source = tmp_path / "src.pth"
    torch.save({"model": light_sd}, source)
    code, out, err = cli(capsys, "convert", source, tmp_path / name, "--no-verify")
    assert_one_line_error(code, out, err, "cannot tell the output format")
    assert "pass --format safetensors" in err
    assert folder_names(tmp_path) == ["src.pth"]


@pytest.mark.full
def test_export_json(official, tmp_path, capsys):
    folder = tmp_path / "folder"
    code, stdout, err = cli(capsys, "export", official, folder, "--json")
    assert code == 0 and err == "", err
    res = json.loads(stdout)
    assert res["ok"] is True and res["model"] == MODEL and res["folder"] == str(folder)
    assert res["files"] == folder_names(folder)
    assert {"README.md", "config.json", "model.safetensors"} <= set(res["files"])
    assert res["report"]["passed"] is True and res["push"] is None


@pytest.mark.full
def test_the_push_command_an_export_prints_keeps_private(official, tmp_path, capsys):
    """The ``push`` command that ``export`` prints, after the folder or in the error of a failed
    upload, keeps ``--private`` and ``--commit-message``: run as printed, it must not create a
    public repository where a private one was asked for."""
    folder = tmp_path / "my export"
    private = ("--private", "--commit-message", "first weights", "--num-inputs", "1")
    code, stdout, err = cli(capsys, "export", official, folder, *private)
    assert code == 0, err
    assert (
        f"upload with: timm-layerscale push '{folder}' ORG/NAME --private --commit-message 'first weights'\n" in stdout
    )
    # The tests run with HF_HUB_OFFLINE set: the upload fails once the folder is written.
    code, stdout, err = cli(capsys, "export", official, folder, "--overwrite", "--push-to-hub", "my-org/x", *private)
    line = assert_one_line_error(code, stdout, err, "HF_HUB_OFFLINE")
    assert line.endswith(
        f"upload it later with: timm-layerscale push '{folder}' my-org/x --private --commit-message 'first weights')"
    ), line
    assert (folder / "model.safetensors").is_file()


@pytest.mark.parametrize(("command", "out"), [("convert", "x.safetensors"), ("export", "folder")])
def test_failed_parity_exits_1_and_writes_nothing(command, out, official, tmp_path, capsys, monkeypatch):
    """The report as a table, or with --json as JSON on stdout, and one error line either way."""
    failing = parity_report(False, REFERENCE, MODEL)
    monkeypatch.setattr(conversion, "verify_outputs", lambda *a, **k: failing)
    work = tmp_path / "work"
    work.mkdir()
    code, stdout, err = cli(capsys, command, official, work / out)
    assert_one_line_error(code, stdout, err, "does not match", status=1)
    assert "FAIL" in stdout
    code, stdout, err = cli(capsys, command, official, work / out, "--json")
    assert_one_line_error(code, stdout, err, "does not match", status=1)
    res = json.loads(stdout)
    assert res["ok"] is False and "does not match" in res["error"] and res["report"]["passed"] is False
    assert folder_names(work) == []


@pytest.fixture(scope="module")
def perturbed(converted, tmp_path_factory) -> Path:
    """The converted file with one class-attention gamma moved by 1e-3."""
    sd = safetensors.torch.load_file(str(converted))
    sd["blocks_token_only.1.ls2.gamma"] = sd["blocks_token_only.1.ls2.gamma"] + 1e-3
    out = tmp_path_factory.mktemp("perturbed") / "perturbed.safetensors"
    safetensors.torch.save_file(sd, str(out))
    return out


def test_verify_exit_0_when_parity_holds(official, converted, capsys):
    code, stdout, err = cli(capsys, "verify", official, converted, "--num-inputs", "1")
    assert code == 0, err
    assert any(line.split() == ["bit-exact", "yes"] for line in stdout.splitlines())
    assert any(line.split()[:2] == ["result", "PASS"] for line in stdout.splitlines())


@pytest.mark.full
def test_verify_exit_1_when_one_weight_differs(official, perturbed, capsys):
    code, stdout, err = cli(capsys, "verify", official, perturbed, "--num-inputs", "1", "--json")
    assert code == 1, err
    rep = json.loads(stdout)
    assert rep["ok"] is rep["passed"] is False and rep["bit_exact"] is False and rep["max_abs_diff"] > 0
    assert rep["weights_equal"] is False and rep["weights_compared"] == 476  # every tensor of the file
    loose = rep["max_abs_diff"] * 10
    code, stdout, err = cli(capsys, "verify", official, perturbed, "--num-inputs", "1", "--atol", loose)
    assert code == 1, "a tolerance loosens the output check, never the weight check"
    assert any(line.split() == ["bit-exact", "no"] for line in stdout.splitlines())
    assert any("NOT all equal to the source's" in line for line in stdout.splitlines())


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is no JSON number")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_standard_json_when_values_are_not_finite(official, converted, tmp_path, capsys):
    """A diverged checkpoint has NaN or infinite gates and outputs: ``--json`` writes them as null."""
    sd = safetensors.torch.load_file(str(converted))
    sd["blocks.0.ls1.gamma"][0] = float("nan")
    sd["blocks.1.ls1.gamma"][:] = float("inf")
    diverged = tmp_path / "diverged.safetensors"
    safetensors.torch.save_file(sd, str(diverged))
    code, stdout, err = cli(capsys, "inspect", diverged, "--json")
    assert code == 0, err
    rows = _strict_json(stdout)["gates"]
    assert rows[0]["ls1"]["mean"] is None and rows[1]["ls1"]["max"] is None and rows[0]["ls2"]["mean"] > 0
    code, stdout, err = cli(capsys, "verify", official, diverged, "--num-inputs", "1", "--json")
    assert code == 1, err
    rep = _strict_json(stdout)
    assert rep["passed"] is False and rep["max_abs_diff"] is None


@pytest.mark.full
def test_verify_exit_2_for_bad_input(official, converted, tmp_path, capsys):
    assert_one_line_error(*cli(capsys, "verify", official, tmp_path / "nope.safetensors"), "not found")
    assert_one_line_error(*cli(capsys, "verify", tmp_path / "nope.pth", converted), "not found")
    assert_one_line_error(*cli(capsys, "verify", official, converted, "--model", "cait_nope"), "unknown model")
    assert_one_line_error(*cli(capsys, "verify", official, converted, "--model", "cait_s24_224_ls"), "mis-shaped")
    shutil.copy(official, damaged := tmp_path / "XXS24_224.pth")  # its checksums do not hold
    damage_inside(damaged, torch.load(official, weights_only=True)["model"]["module.head.weight"], 4096)
    for argv in [(damaged, converted), (official, damaged)]:
        line = assert_one_line_error(*cli(capsys, "verify", *argv), "is corrupt (Bad CRC-32")
        assert str(damaged) in line


def test_json_says_a_user_error_on_stdout_too(official, converted, tmp_path, capsys):
    """With ``--json`` a script reading stdout gets ``{"ok": false, "error": ...}`` for a user's
    mistake as for a failed check; the error line on stderr and the exit status are unchanged."""
    for argv in [
        ("convert", tmp_path / "nope.pth", tmp_path / "out.safetensors"),
        ("verify", official, tmp_path / "nope.safetensors"),
        ("inspect", tmp_path / "nope.pth"),
        ("push", tmp_path, "my-org/model", "--dry-run"),
    ]:
        code, out, err = cli(capsys, *argv, "--json")
        line = assert_one_line_error(code, out, err)
        assert _strict_json(out) == {"ok": False, "error": line.removeprefix("timm-layerscale: error: ")}
        assert cli(capsys, *argv)[1] == ""
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.full
def test_list(capsys, monkeypatch):
    from timm_layerscale import catalog

    # Build the catalogue once for both output formats (each build makes every model on meta).
    monkeypatch.setattr(catalog, "model_catalog", functools.lru_cache(catalog.model_catalog))

    code, stdout, err = cli(capsys, "list")
    assert code == 0, err
    header, *lines = stdout.splitlines()
    assert header.split()[:2] == ["model", "reference"] and "params" in header and "pretrained" in header
    by_name = {line.split()[0]: line.split() for line in lines}
    assert by_name[MODEL][2:5] == ["12.0", "224", "1e-05"]

    code, stdout, _ = cli(capsys, "list", "--json")
    rows = {r["name"]: r for r in json.loads(stdout)}
    assert code == 0 and set(rows) == set(by_name)
    row = rows[MODEL]
    assert (row["reference"], row["resolution"], row["init_value"]) == (REFERENCE, 224, 1e-5)
    assert 11_000_000 < row["params"] < 13_000_000 and isinstance(row["pretrained"], list)


@pytest.mark.parametrize("folder", [".", "..", "../inside"])
@pytest.mark.parametrize("command", ["demo", "export"])
def test_the_current_folder_is_never_replaced(tmp_path, capsys, monkeypatch, command, folder):
    # The folder a shell stands in: replacing it deleted its files, then failed halfway.
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "inside")
    argv = ["demo", "--out", folder] if command == "demo" else ["export", "never-read.pth", folder]
    code, out, err = cli(capsys, *argv, "--overwrite")
    assert_one_line_error(code, out, err, "is or holds the current folder", stdout="")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["inside", "inside/keep.txt"]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    code, stdout, err = cli(capsys, "demo", "--out", tmp_path / "demo")
    assert code == 0, err
    assert any(line.split() == ["bit-exact", "yes"] for line in stdout.splitlines())
    assert "bit-exact: yes" in stdout and "demo passed" in stdout


def _nonfinite(sd: dict, value: float) -> dict:
    bad = sd["module.blocks.5.attn.proj.weight"].clone()
    bad[3, 7] = value
    return {**sd, "module.blocks.5.attn.proj.weight": bad}


#: The official file's state dict as each kind of bad input changes it.
EDITS = {
    "missing-key": lambda sd: {k: v for k, v in sd.items() if k != "module.blocks.0.norm1.bias"},
    "extra-key": lambda sd: {**sd, "module.blocks.24.norm1.weight": torch.ones(192)},
    "unknown-key": lambda sd: {**sd, "module.blocks.0.attn.rope.freqs": torch.ones(4)},
    "misshaped": lambda sd: {**sd, "module.blocks.3.mlp.fc1.bias": torch.zeros(700)},
    "nan": lambda sd: _nonfinite(sd, float("nan")),
    "inf": lambda sd: _nonfinite(sd, float("inf")),
    "integer": lambda sd: {**sd, "module.blocks.0.mlp.fc1.weight": sd["module.blocks.0.mlp.fc1.weight"].long()},
    "no-ema": lambda sd: sd,
}


def _write(kind: str, src: Path, light_sd: dict) -> None:
    plain = {k.removeprefix("module."): v for k, v in light_sd.items()}
    if kind == "directory":
        src.mkdir()
    elif kind == "empty":
        src.touch()
    elif kind == "truncated-pth":
        torch.save({"model": light_sd}, src)
        src.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    elif kind == "damaged-pth":
        torch.save({"model": light_sd}, src)
        damage_inside(src, light_sd["module.blocks.5.attn.proj.weight"])
    elif kind == "truncated-safetensors":
        safetensors.torch.save_file(
            {k: plain[k].contiguous() for k in ("cls_token", "pos_embed", "norm.weight")}, str(src)
        )
        src.write_bytes(src.read_bytes()[:-100])
    elif kind == "text":
        src.write_text("<!DOCTYPE html>\n<html><body>Not Found</body></html>\n")
    elif kind == "resnet":
        import timm

        torch.save({"state_dict": timm.create_model("resnet10t", num_classes=10).state_dict()}, src)
    elif kind in EDITS:
        torch.save({"model": EDITS[kind](dict(light_sd))}, src)
    elif kind == "no-weights":
        torch.save({"state_dict": {}}, src)
    elif kind == "no-weights-safetensors":
        safetensors.torch.save_file({}, str(src))
    else:
        raise AssertionError(kind)


BAD_INPUTS = [
    # (kind, file name, extra arguments, expected text in the one-line error)
    ("missing", "XXS24_224.pth", [], "not found"),
    ("directory", "XXS24_224.pth", [], "holds neither model.safetensors nor model.safetensors.index.json nor"),
    ("empty", "XXS24_224.pth", [], "is empty"),
    ("truncated-pth", "XXS24_224.pth", [], "truncated"),
    ("truncated-safetensors", "model.safetensors", [], "truncated"),
    ("damaged-pth", "XXS24_224.pth", [], "is corrupt (Bad CRC-32 for file"),
    ("damaged-pth", "XXS24_224.pth", ["--no-verify"], "download it again"),
    ("text", "XXS24_224.pth", [], "text file"),
    ("resnet", "resnet.pth", [], "does not fit any convertible model"),
    ("missing-key", "XXS24_224.pth", [], "closest is cait_xxs24_224_ls"),
    ("missing-key", "XXS24_224.pth", ["--model", MODEL], "1 missing (blocks.0.norm1.bias [192])"),
    ("extra-key", "XXS24_224.pth", [], "closest is cait_xxs24_224_ls"),
    ("extra-key", "XXS24_224.pth", ["--model", MODEL], "1 unexpected (blocks.24.norm1.weight [192])"),
    (
        "unknown-key",
        "XXS24_224.pth",
        ["--model", MODEL],
        "not part of a CaiT (official layout) checkpoint: blocks.0.attn.rope.freqs",
    ),
    ("misshaped", "XXS24_224.pth", ["--model", MODEL], "1 mis-shaped (blocks.3.mlp.fc1.bias [700] != [768])"),
    (
        "nan",
        "XXS24_224.pth",
        [],
        "NaN or Inf, first 'blocks.5.attn.proj.weight'; check the source checkpoint, or pass --allow-nonfinite",
    ),
    ("inf", "XXS24_224.pth", [], "--allow-nonfinite"),
    ("integer", "XXS24_224.pth", [], "blocks.0.mlp.fc1.weight is int64"),
    ("no-ema", "XXS24_224.pth", ["--ema"], "no 'model_ema' state dict (wrappers found: model); leave out --ema"),
    ("no-weights", "XXS24_224.pth", [], "XXS24_224.pth holds no weights (an empty state dict); pass a checkpoint"),
    ("no-weights-safetensors", "model.safetensors", [], "model.safetensors holds no weights (an empty state dict)"),
    (
        "missing-key",
        "XXS24_224.pth",
        ["--model", "cait_xxs24_224_lss"],
        "unknown model 'cait_xxs24_224_lss'; did you mean cait_xxs24_224_ls",
    ),
]


@pytest.mark.parametrize(
    "kind,name,extra,expect", BAD_INPUTS, ids=[f"{k}{'-' + e[-1] if e else ''}" for k, _, e, _ in BAD_INPUTS]
)
def test_bad_input(kind, name, extra, expect, light_sd, tmp_path, capsys):
    src = tmp_path / "src" / name
    src.parent.mkdir()
    if kind != "missing":
        _write(kind, src, light_sd)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    line = assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.safetensors", *extra), expect)
    if "unknown model" not in expect:  # the file at fault is named
        assert str(src) in line
    assert folder_names(out_dir) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.full
def test_a_nonfinite_weight_converts_and_verifies_with_allow_nonfinite(value, official, tmp_path, capsys):
    """With allow_nonfinite the parity check still runs: the weight is copied as it is and both
    models compute NaN (or Inf) in the same places, which is parity, not weights that differ."""
    ckpt = torch.load(official, weights_only=True)
    ckpt["model"]["module.blocks.5.attn.proj.weight"][0, 0] = value
    src = tmp_path / "nonfinite.pth"
    torch.save(ckpt, src)
    out = tmp_path / "nonfinite.safetensors"
    code, stdout, err = cli(capsys, "convert", src, out, "--allow-nonfinite", "--num-inputs", "2", "--json")
    assert code == 0, err
    report = json.loads(stdout)["report"]
    assert report["passed"] and report["bit_exact"] and report["weights_equal"], report
    code, stdout, err = cli(capsys, "verify", src, out, "--num-inputs", "2")
    assert code == 0 and "PASS (bit-exact)" in stdout, err
    code, stdout, _ = cli(capsys, "verify", official, out, "--num-inputs", "2")
    assert code == 1 and "FAIL" in stdout


def test_a_cast_that_overflows_is_said_before_verification(light_sd, tmp_path, capsys):
    """A finite weight beyond fp16's range becomes Inf in the cast: one line saying so, not a
    parity failure with NaN differences (both models would give NaN), and not an Inf written
    unchecked without verification; bf16 holds it."""
    src = tmp_path / "big.pth"
    big = light_sd["module.blocks.5.attn.proj.weight"].clone()
    big[3, 7] = 1e6
    torch.save({"model": dict(light_sd, **{"module.blocks.5.attn.proj.weight": big})}, src)
    out = tmp_path / "out.safetensors"
    expect = (
        f"{src}: 'blocks.5.attn.proj.weight' holds values beyond fp16's range (up to 65504), which the cast makes Inf; "
        "pass --dtype bf16, or leave out --dtype fp16"
    )
    assert_one_line_error(*cli(capsys, "convert", src, out, "--dtype", "fp16", "--num-inputs", "1"), expect)
    assert_one_line_error(*cli(capsys, "convert", src, out, "--dtype", "fp16", "--no-verify"), expect)
    assert not out.exists()
    assert cli(capsys, "convert", src, out, "--dtype", "fp16", "--no-verify", "--allow-nonfinite")[0] == 0
    assert torch.isinf(safetensors.torch.load_file(out)["blocks.5.attn.proj.weight"]).sum() == 1
    out.unlink()
    assert cli(capsys, "convert", src, out, "--dtype", "bf16", "--num-inputs", "1")[0] == 0


def test_interrupted_verification_removes_the_output(official, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "verify_outputs", interrupted)
    assert_one_line_error(*cli(capsys, "convert", official, tmp_path / "x.safetensors"), "interrupted", status=130)
    assert folder_names(tmp_path) == []


def test_unreadable_image_file_leaves_no_output(official, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = cli(capsys, "convert", official, out_dir / "x.safetensors", "--images", tmp_path / "missing.png")
    assert_one_line_error(*result, "missing.png (No such file or directory); pass image files Pillow opens")
    assert folder_names(out_dir) == []


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        main(["--debug", "convert", str(tmp_path / "nope.pth"), str(tmp_path / "out.safetensors")])
    with pytest.raises(CheckpointError, match="not found"):
        main(["convert", str(tmp_path / "nope.pth"), str(tmp_path / "out.safetensors"), "--debug"])


def test_an_internal_error_exits_3_with_the_common_prefix(capsys, monkeypatch):
    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setitem(commands.COMMANDS, "list", broken)
    line = assert_one_line_error(
        *cli(capsys, "list"), status=3, expect="internal error: TypeError: unsupported operand"
    )
    assert "--debug" in line


@pytest.mark.parametrize("reader", ["left", "full device"])
@pytest.mark.full
def test_an_output_that_refuses_the_table(reader, tmp_path):
    """``| head`` may leave before the table (or the help) is written: the command ends quietly,
    with 141 as a Unix tool killed by SIGPIPE; a full device is one error line. Python's own flush
    at exit adds no "Exception ignored" lines (run without ``PYTHONUNBUFFERED``, as most users run)."""
    if reader == "left":
        r, w = os.pipe()
        os.close(r)
    elif os.path.exists("/dev/full"):
        w = os.open("/dev/full", os.O_WRONLY)
    else:
        pytest.skip("no /dev/full here")
    from safetensors.torch import save_file

    save_file({"blocks.0.ls1.gamma": torch.ones(4)}, tmp_path / "gates.safetensors")
    p = run_python_into(w, "-m", "timm_layerscale", "inspect", str(tmp_path / "gates.safetensors"))
    if reader == "left":
        assert (p.returncode, p.stderr) == (141, "")
    else:
        assert_one_line_error(p.returncode, "", p.stderr, expect="writing the output failed (No space left on device)")


def test_demo_parity_failure_prints_the_report_and_exits_1(tmp_path, capsys, monkeypatch):
    from timm_layerscale import demo
    from timm_layerscale.hub import export

    def export_folder(*args, **kwargs):
        raise ParityError("converted model does not match cait_xxs24_224 (max abs diff 0.5)", parity_report(False))

    monkeypatch.setattr(export, "export_folder", export_folder)
    monkeypatch.setattr(demo, "write_official_checkpoint", lambda path, *a, **k: Path(path).touch())
    code, out, err = cli(capsys, "demo", "--out", tmp_path / "demo")
    assert_one_line_error(code, out, err, "parity check failed", status=1)
    assert any(line.split() == ["result", "FAIL"] for line in out.splitlines()), out
    assert "demo FAILED" in out.splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{bad}.pth", "out.safetensors"],
        ["convert", "{official}", "{bad}.safetensors"],
        ["export", "{official}", "{bad}"],
    ],
)
def test_a_name_not_in_utf8_is_a_user_error(argv, official, tmp_path, capsys, monkeypatch):
    """PyTorch and safetensors open UTF-8 paths only; a name in another encoding (an old archive's
    Latin-1 ``café``) is refused before anything is read or written."""
    bad = os.fsdecode(b"caf\xe9")
    try:
        shutil.copy(official, tmp_path / f"{bad}.pth")
    except (OSError, UnicodeError):
        pytest.skip("this filesystem refuses names that are not UTF-8")
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, out, err = cli(capsys, *(a.format(bad=bad, official=official) for a in argv))
    assert_one_line_error(code, out, err, "is not a UTF-8 name", stdout="")
    assert sorted(os.listdir(tmp_path)) == before


def test_running_out_of_memory_is_one_line(official, tmp_path, capsys, monkeypatch):
    """More seeded images than any machine holds (60 PB) end in one line that says what to do,
    not an internal error to report. A seed out of torch's range is refused by the options too."""
    from timm_layerscale.errors import LayerScaleError
    from timm_layerscale.parity import inputs, verify
    from timm_layerscale.parity.tolerance import VerifyOptions

    monkeypatch.setattr(verify, "seeded_inputs", inputs.seeded_inputs)  # every image asked for

    conv = tmp_path / "c.safetensors"
    assert cli(capsys, "convert", official, conv, "--no-verify")[0] == 0
    advice = "out of memory; free memory, or verify with a smaller --batch-size or --num-inputs"
    assert_one_line_error(*cli(capsys, "verify", official, conv, "--num-inputs", "100000000000"), expect=advice)
    with pytest.raises(LayerScaleError, match=r"seed must be from -2\*\*63 to 2\*\*64 - 1"):
        VerifyOptions(seed=-(2**63) - 1)


def test_advice_names_options_as_the_caller_passes_them(tmp_path, capsys, official):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(Exception, match="pass overwrite=True to replace it"):
        convert_checkpoint(official, out, verify=False)
    assert_one_line_error(*cli(capsys, "convert", official, out), status=2, expect="pass --overwrite to replace it")
    assert out.read_bytes() == b"keep me"
    assert (option("model", "cait_s24_224_ls"), option("fmt", "pth")) == ("model='cait_s24_224_ls'", "fmt='pth'")


def test_conflicting_push_options_are_named_as_options(tmp_path, capsys):
    code, out, err = cli(capsys, "push", tmp_path, "my-org/model", "--create-pr", "--revision", "dev", "--dry-run")
    assert_one_line_error(code, out, err, "leave out --create-pr or --revision dev", stdout="")


def test_inspect_plot_without_matplotlib_fails_before_printing(official, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = cli(capsys, "inspect", official, "--plot", "gates.png")
    assert_one_line_error(code, out, err, "pip install 'timm-layerscale[plot]'")
    assert out == ""


def test_inspect_never_replaces_a_plot_without_overwrite(official, tmp_path, capsys, monkeypatch):
    plot = tmp_path / "gates.png"
    plot.write_bytes(b"kept")
    read: list[tuple] = []

    def load(*args) -> dict:
        read.append(args)
        return {}

    monkeypatch.setattr("timm_layerscale.files.read.read_checkpoint", load)
    code, out, err = cli(capsys, "inspect", official, "--plot", plot)
    assert_one_line_error(code, out, err, f"output {plot} exists; pass --overwrite to replace it", stdout="")
    assert plot.read_bytes() == b"kept" and read == []  # refused before the checkpoint is read
    code, out, err = cli(capsys, "inspect", official, "--plot", tmp_path / "missing" / "gates.png")
    assert_one_line_error(code, out, err, "does not exist; create it or choose another output path", stdout="")
    monkeypatch.undo()
    assert cli(capsys, "inspect", official, "--plot", plot, "--overwrite")[0] == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.full
def test_export_never_replaces_the_folder_that_holds_its_source(official, tmp_path, capsys):
    folder = tmp_path / "downloads"
    folder.mkdir()
    source = folder / official.name
    shutil.copyfile(official, source)
    for overwrite in (["--overwrite"], []):  # without it too: advising --overwrite would only lead here
        code, out, err = cli(capsys, "export", source, folder, *overwrite)
        assert_one_line_error(code, out, err, "holds the source", stdout="")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["XXS24_224.pth", "downloads"]
    # A folder's own weights are written again: re-exporting a folder onto itself is allowed.
    assert cli(capsys, "export", source, tmp_path / "out")[0] == 0
    assert cli(capsys, "export", tmp_path / "out", tmp_path / "out", "--overwrite")[0] == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges there")
def test_convert_onto_a_link_replaces_the_file_it_leads_to(official, tmp_path, capsys):
    real = tmp_path / "runs" / "model.safetensors"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "latest.safetensors"
    link.symlink_to(real)
    code, out, err = cli(capsys, "convert", official, link, "--no-verify")
    assert_one_line_error(code, out, err, f"output {link} exists; pass --overwrite to replace it", stdout="")
    assert real.read_bytes() == b"old"
    assert cli(capsys, "convert", official, link, "--overwrite", "--no-verify")[0] == 0
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link stays, its file is new
    assert real.read_bytes()[8:10] == b'{"'
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["latest.safetensors", "model.safetensors", "runs"]


@pytest.mark.parametrize(
    "options",
    [
        dict(atol=0.0),
        dict(atol=0.0, rtol=0.0),
        dict(rtol=1e-3, seed=7, batch_size=1),
        dict(exact=True, num_inputs=2, images=("a.png", "b b.png")),
        dict(num_inputs=0, images=("a.png",)),
    ],
    ids=["atol-0", "atol-rtol-0", "rtol-seed-batch", "exact-images", "images-only"],
)
@pytest.mark.parametrize("command", ["convert", "verify", "export"])
def test_the_reproducing_command_line_parses_back_to_the_same_options(command, options):
    """The model card's "Made with" line and convert's ``command``: a zero is a value, not an absence."""
    import shlex

    from timm_layerscale.cli import build_parser
    from timm_layerscale.options import command_line, verify_options
    from timm_layerscale.parity.tolerance import VerifyOptions

    given = VerifyOptions(**options)
    argv = shlex.split(command_line(("timm-layerscale", command, "a.pth", "out"), given))
    assert verify_options(build_parser().parse_args(argv[1:])) == given


def test_every_export_and_push_option_reaches_the_library(tmp_path, capsys, monkeypatch):
    from timm_layerscale.hub import export, upload
    from timm_layerscale.parity.tolerance import VerifyOptions

    calls = {}

    def record(name):
        def call(*args, **kwargs):
            calls[name] = (args, kwargs)
            return SimpleNamespace(summary=lambda: "done", to_dict=dict)

        return call

    monkeypatch.setattr(export, "export_folder", record("export"))
    monkeypatch.setattr(upload, "push_folder", record("push"))
    labels = tmp_path / "labels.txt"
    code, out, err = cli(
        capsys, "export", "src.pth", "hub/x", "--model", MODEL, "--overwrite", "--ema", "--push-to-hub", "org/x",
        "--private", "--commit-message", "first", "--repo-id", "org/y", "--to", "gamma", "--label-names", labels,
        "--tag", "fb_dist_in1k", "--seed", "3", "--device", "cpu", "--num-inputs", "2",
    )  # fmt: skip
    assert (code, out, err) == (0, "done\n", "")
    assert calls["export"] == (
        ("src.pth", "hub/x"),
        dict(
            model=MODEL, overwrite=True, ema=True, options=VerifyOptions(seed=3, num_inputs=2), push_to_hub="org/x",
            private=True, commit_message="first", repo_id="org/y", to="gamma", label_names=str(labels),
            tag="fb_dist_in1k",
        ),
    )  # fmt: skip
    argv = ["push", "hub/x", "org/x", "--private", "--revision", "dev", "--create-pr", "--commit-message", "m"]
    assert cli(capsys, *argv, "--dry-run") == (0, "done\n", "")
    assert calls["push"] == (
        ("hub/x", "org/x"),
        dict(private=True, revision="dev", create_pr=True, commit_message="m", dry_run=True),
    )


@pytest.mark.full
def test_progress_bars_show_on_a_terminal_and_not_with_quiet(official, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "enabled", lambda: not progress._disabled)
    monkeypatch.setattr(progress, "DELAY", 0)
    monkeypatch.setattr(progress, "_disabled", False)
    from timm_layerscale.parity import verify

    monkeypatch.setattr(verify, "seeded_inputs", lambda n, img, seed: torch.randn(2, 3, 224, 224))
    code, _, err = cli(capsys, "convert", official, tmp_path / "a.safetensors")
    assert code == 0, err
    assert "writing a.safetensors" in err and "verifying" in err and "batch" in err

    code, _, err = cli(capsys, "convert", official, tmp_path / "b.pth", "--no-verify")
    assert code == 0 and "writing b.pth" in err

    code, _, err = cli(capsys, "convert", official, tmp_path / "c.safetensors", "--quiet")
    assert code == 0 and err == ""


def test_a_pth_written_through_the_progress_counter_loads_memory_mapped(tmp_path, monkeypatch):
    from timm_layerscale.files.read import load_checkpoint
    from timm_layerscale.files.save import save_pth

    monkeypatch.setattr(progress, "enabled", lambda: True)
    monkeypatch.setattr(progress, "DELAY", 0)
    sd = {"a": torch.arange(1000.0), "b": torch.ones(33, 4, dtype=torch.bfloat16)}
    save_pth(tmp_path / "x.pth", sd)
    loaded = load_checkpoint(tmp_path / "x.pth")  # torch.load(mmap=True, weights_only=True)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pth"]


def test_push_offline_fails_before_reading_a_token(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "cait_xxs24_224_ls"}))
    (folder / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: pytest.fail("read the token"), raising=False)
    assert_one_line_error(
        *cli(capsys, "push", folder, "org/name"), status=2, expect="HF_HUB_OFFLINE is set, so uploading to org/name"
    )


@pytest.mark.full
def test_a_failure_after_reading_exits_without_waiting_for_the_checksums(official, tmp_path):
    """The source's checksums run in the background; a command that fails meanwhile exits at once."""
    script = (
        "import sys, time\nfrom timm_layerscale import cli\nfrom timm_layerscale.files import read\n"
        "read.scan_file = lambda path: time.sleep(900)\n"
        f"sys.exit(cli.main(['convert', {str(official)!r}, {str(tmp_path / 'out.safetensors')!r}, "
        "'--model', 'cait_s24_224_ls']))"
    )
    p = _python("-c", script)  # a wait for the checksums would pass its time-out
    assert p.returncode == 2 and "mis-shaped" in p.stderr, p.stderr
