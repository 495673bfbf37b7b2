"""The ``timm-layerscale`` command line: subcommands, exit codes, and every bad input.

Most tests call :func:`timm_layerscale.cli.main` in-process; a few run the console
script (``python -m timm_layerscale``) in a subprocess. Bad inputs must give exit
status 2 (130 for an interruption), exactly one line on stderr starting with
``timm-layerscale: error:``, no traceback, and nothing left in the output folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
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
from timm_layerscale.conversion.keys import to_gamma
from timm_layerscale.converter import convert_checkpoint
from timm_layerscale.errors import CheckpointError, ParityError, RemapError, option
from timm_layerscale.families import get_variant
from timm_layerscale.files import save as ckpt_save

MODEL = "cait_xxs24_224_ls"
REFERENCE = "cait_xxs24_224"


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli-converted") / f"{MODEL}.safetensors"
    convert_checkpoint(official, out, verify=False)
    return out


@pytest.fixture(scope="module")
def light_sd() -> dict[str, torch.Tensor]:
    """Official-layout keys and shapes of cait_xxs24_224 with tiny storage (rows broadcast).

    Detection and key checks only read shapes, so bad-input files built from this are
    a few hundred kB instead of 48 MB.
    """
    gen = torch.Generator().manual_seed(0)
    shapes = to_gamma(state_dict_shapes(get_variant(MODEL)), "cait")
    return {"module." + k: torch.randn(s[-1], generator=gen).expand(s) for k, s in shapes.items()}


def folder_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- help and the console script --------------------------------------------------------


def _python(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, **kw)


def test_console_script_help_lists_examples():
    proc = _python("-m", "timm_layerscale", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "examples:" in proc.stdout
    for cmd in ("convert", "verify", "list", "demo"):
        assert f"timm-layerscale {cmd}" in proc.stdout
    assert proc.stderr == ""


_NO_TORCH = """
import contextlib, io, json, runpy, sys
results = {}
for argv in (["--help"], ["convert", "--help"], ["convert", "only-one-arg"], ["--version"]):
    sys.argv = ["timm-layerscale", *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("timm_layerscale", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    results[" ".join(argv)] = [code, out.getvalue(), err.getvalue()]
results["torch imported"] = "torch" in sys.modules
print(json.dumps(results))
"""


def test_help_and_argument_errors_do_not_import_torch():
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


# ---- convert ----------------------------------------------------------------------------


def test_convert_prints_the_parity_table(official, tmp_path, capsys, few_inputs):
    out = tmp_path / "xxs24.safetensors"
    code, stdout, err = cli(capsys, "convert", official, out)
    assert code == 0, err
    assert err == ""
    assert f"as {MODEL}" in stdout and "(gamma layout)" in stdout and "(ls layout)" in stdout
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in stdout.splitlines()[1:] if "  " in line}
    assert rows["bit-exact"] == "yes" and rows["result"] == "PASS (bit-exact)"
    assert rows["weights"].endswith("tensors equal to the source")
    assert rows["reference"] == REFERENCE and rows["converted"] == MODEL
    assert folder_names(tmp_path) == ["xxs24.safetensors"]


def test_convert_json(official, tmp_path, capsys, few_inputs):
    out = tmp_path / "xxs24.safetensors"
    code, stdout, err = cli(capsys, "convert", official, out, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["ok"] is True and res["model"] == MODEL and res["output"] == str(out)
    assert res["source_sha256"] == hashlib.sha256(official.read_bytes()).hexdigest()
    assert (res["source_layout"], res["target_layout"]) == ("gamma", "ls")
    assert res["metadata"]["format"] == "pt" and res["metadata"]["architecture"] == MODEL
    rep = res["report"]
    assert rep["bit_exact"] is True and rep["passed"] is True and rep["max_abs_diff"] == 0
    for key in (
        "max_rel_diff",
        "cosine_min",
        "top1_agreement",
        "top5_agreement",
        "dtype",
        "device",
        "attention",
        "versions",
    ):
        assert key in rep

    code, stdout, _ = cli(capsys, "convert", out, tmp_path / "g.pth", "--to", "gamma", "--no-verify", "--json")
    res = json.loads(stdout)
    assert code == 0 and res["report"] is None and res["target_layout"] == "gamma"
    assert res["container"] == "{'model': {'module.' + key: tensor}}"
    assert "ls1.gamma" not in str(list(torch.load(tmp_path / "g.pth", weights_only=True)["model"]))


def test_convert_dtype_and_format_options(official, tmp_path, capsys):
    out = tmp_path / "half.bin"
    code, _, err = cli(capsys, "convert", official, out, "--format", "safetensors", "--dtype", "fp16", "--no-verify")
    assert code == 0, err
    sd = safetensors.torch.load_file(str(out))
    assert {v.dtype for v in sd.values()} == {torch.float16}


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


@pytest.mark.parametrize("name", ["out.txt", "out", "model.npz"])
def test_convert_refuses_an_output_suffix_that_names_no_format(light_sd, tmp_path, capsys, name):
    source = tmp_path / "src.pth"
    torch.save({"model": light_sd}, source)
    code, out, err = cli(capsys, "convert", source, tmp_path / name, "--no-verify")
    assert_one_line_error(code, out, err, "cannot tell the output format")
    assert "pass --format safetensors" in err
    assert folder_names(tmp_path) == ["src.pth"]


@pytest.mark.parametrize("name, fmt", [("OUT.PTH", "pth"), ("x.ckpt", "pth"), ("x.SafeTensors", "safetensors")])
def test_convert_output_suffix_any_case(light_sd, tmp_path, capsys, name, fmt):
    source = tmp_path / "src.pth"
    torch.save({"model": light_sd}, source)
    code, _, err = cli(capsys, "convert", source, tmp_path / name, "--no-verify")
    assert code == 0, err
    head = (tmp_path / name).read_bytes()[:4]
    assert (head == b"PK\x03\x04") == (fmt == "pth")


def test_convert_integer_weight_is_a_user_error(light_sd, tmp_path, capsys):
    key = "module.blocks.0.mlp.fc1.weight"
    source = tmp_path / "int.pth"
    torch.save({"model": dict(light_sd, **{key: light_sd[key].to(torch.int64)})}, source)
    code, out, err = cli(capsys, "convert", source, tmp_path / "out.safetensors")
    assert_one_line_error(code, out, err, "blocks.0.mlp.fc1.weight is int64")
    assert "float32, bfloat16 or float16" in err
    assert folder_names(tmp_path) == ["int.pth"]


def test_export_json(official, tmp_path, capsys):
    folder = tmp_path / "folder"
    code, stdout, err = cli(capsys, "export", official, folder, "--json")
    assert code == 0 and err == "", err
    res = json.loads(stdout)
    assert res["ok"] is True and res["model"] == MODEL and res["folder"] == str(folder)
    assert res["files"] == folder_names(folder)
    assert {"README.md", "config.json", "model.safetensors"} <= set(res["files"])
    assert res["report"]["passed"] is True and res["push"] is None

    code, stdout, err = cli(capsys, "push", folder, "my-org/model", "--dry-run", "--json")
    assert code == 0 and err == "", err
    plan = json.loads(stdout)
    assert plan["ok"] is True and plan["repo_id"] == "my-org/model" and plan["folder"] == str(folder)
    assert plan["dry_run"] is True
    assert plan["files"] == [[name, (folder / name).stat().st_size] for name in folder_names(folder)]
    assert plan["revision"] is None and plan["commit_url"] is None and "Upload" in plan["commit_message"]


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
    monkeypatch.setattr(conversion, "verify_state_dicts", lambda *a, **k: failing)
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


# ---- verify: exit 0 / 1 / 2 -------------------------------------------------------------


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


def test_verify_exit_1_when_one_weight_differs(official, perturbed, capsys):
    code, stdout, err = cli(capsys, "verify", official, perturbed, "--num-inputs", "1", "--json")
    assert code == 1, err
    rep = json.loads(stdout)
    assert rep["ok"] is rep["passed"] is False and rep["bit_exact"] is False and rep["max_abs_diff"] > 0
    loose = rep["max_abs_diff"] * 10
    code, stdout, err = cli(capsys, "verify", official, perturbed, "--num-inputs", "1", "--atol", loose)
    assert code == 1, "a tolerance loosens the output check, never the weight check"
    assert any(line.split() == ["bit-exact", "no"] for line in stdout.splitlines())
    assert any("NOT equal to the source" in line for line in stdout.splitlines())


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
    rows = _strict_json(stdout)
    assert rows[0]["ls1"]["mean"] is None and rows[1]["ls1"]["max"] is None and rows[0]["ls2"]["mean"] > 0
    code, stdout, err = cli(capsys, "verify", official, diverged, "--num-inputs", "1", "--json")
    assert code == 1, err
    rep = _strict_json(stdout)
    assert rep["passed"] is False and rep["max_abs_diff"] is None


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


# ---- list and demo ----------------------------------------------------------------------


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


def test_list(capsys, monkeypatch):
    from timm_layerscale import catalog
    from timm_layerscale.models import cait_ls

    # Build the catalogue once for both output formats (each build makes every model on meta).
    monkeypatch.setattr(catalog, "model_catalog", functools.lru_cache(catalog.model_catalog))

    code, stdout, err = cli(capsys, "list")
    assert code == 0, err
    header, *lines = stdout.splitlines()
    assert header.split()[:2] == ["model", "reference"] and "params" in header and "pretrained" in header
    by_name = {line.split()[0]: line.split() for line in lines}
    for name, ref in ((n, v.reference) for n, v in cait_ls.VARIANTS.items()):
        assert by_name[name][1] == ref
    assert by_name[MODEL][2:5] == ["12.0", "224", "1e-05"]

    code, stdout, _ = cli(capsys, "list", "--json")
    rows = {r["name"]: r for r in json.loads(stdout)}
    assert code == 0 and set(rows) == set(by_name)
    row = rows[MODEL]
    assert (row["reference"], row["resolution"], row["init_value"]) == (REFERENCE, 224, 1e-5)
    assert 11_000_000 < row["params"] < 13_000_000 and isinstance(row["pretrained"], list)


def test_demo_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert_one_line_error(*cli(capsys, "demo", "--out", tmp_path), "--overwrite")
    assert folder_names(tmp_path) == ["keep.txt"]


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


@pytest.mark.parametrize("command", ["demo", "export"])
def test_a_folder_named_through_dotdot_is_the_folder_it_leads_to(official, tmp_path, capsys, command):
    # a/b/.. is a; its temporary sibling and its name were taken from b: export failed at the last
    # rename (Device or resource busy), demo emptied a and then failed (No such file or directory).
    (tmp_path / "a" / "b").mkdir(parents=True)
    folder = tmp_path / "a" / "b" / ".."
    argv = ["demo", "--out", folder] if command == "demo" else ["export", official, folder]
    code, _, err = cli(capsys, *argv, "--overwrite", "--num-inputs", "1")
    assert code == 0, err
    assert folder_names(tmp_path) == ["a"]
    if command == "demo":
        assert folder_names(tmp_path / "a") == ["XXS24_224.pth", f"{MODEL}.fb_dist_in1k"]
    else:
        names = folder_names(tmp_path / "a")
        assert {"README.md", "config.json", "model.safetensors"} <= set(names) and "b" not in names
        assert 'create_model("hf-hub:ORG/a"' in (tmp_path / "a" / "README.md").read_text()


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    code, stdout, err = cli(capsys, "demo", "--out", tmp_path / "demo")
    assert code == 0, err
    assert any(line.split() == ["bit-exact", "yes"] for line in stdout.splitlines())
    assert "bit-exact: yes" in stdout and "demo passed" in stdout


# ---- bad input: one line, exit 2, nothing left behind -----------------------------------


class _TouchOnLoad:
    """Unpickling this calls ``Path(path).touch()``: code run by loading a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


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
    elif kind == "missing-key":
        torch.save({"model": {k: v for k, v in light_sd.items() if k != "module.blocks.0.norm1.bias"}}, src)
    elif kind == "extra-key":
        torch.save({"model": dict(light_sd, **{"module.blocks.24.norm1.weight": torch.ones(192)})}, src)
    elif kind == "unknown-key":
        torch.save({"model": dict(light_sd, **{"module.blocks.0.attn.rope.freqs": torch.ones(4)})}, src)
    elif kind == "misshaped":
        torch.save({"model": dict(light_sd, **{"module.blocks.3.mlp.fc1.bias": torch.zeros(700)})}, src)
    elif kind in ("nan", "inf"):
        bad = light_sd["module.blocks.5.attn.proj.weight"].clone()
        bad[3, 7] = float(kind)
        torch.save({"model": dict(light_sd, **{"module.blocks.5.attn.proj.weight": bad})}, src)
    elif kind == "no-ema":
        torch.save({"model": light_sd}, src)
    elif kind == "no-weights":
        torch.save({"state_dict": {}}, src)
    elif kind == "no-weights-safetensors":
        safetensors.torch.save_file({}, str(src))
    else:
        raise AssertionError(kind)


BAD_INPUTS = [
    # (kind, file name, extra arguments, expected text in the one-line error)
    ("missing", "XXS24_224.pth", [], "not found"),
    ("directory", "XXS24_224.pth", [], "holds neither model.safetensors nor pytorch_model.bin"),
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
    ("unknown-key", "XXS24_224.pth", ["--model", MODEL], "not part of a cait checkpoint: blocks.0.attn.rope.freqs"),
    ("misshaped", "XXS24_224.pth", ["--model", MODEL], "1 mis-shaped (blocks.3.mlp.fc1.bias [700] != [768])"),
    (
        "nan",
        "XXS24_224.pth",
        [],
        "NaN or Inf, first 'blocks.5.attn.proj.weight'; check the source checkpoint, or pass --allow-nonfinite",
    ),
    ("inf", "XXS24_224.pth", [], "--allow-nonfinite"),
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


def test_nonfinite_values_convert_with_allow_nonfinite(light_sd, tmp_path, capsys):
    src = tmp_path / "nan.pth"
    _write("nan", src, light_sd)
    out = tmp_path / "nan.safetensors"
    code, _, err = cli(capsys, "convert", src, out, "--allow-nonfinite", "--no-verify")
    assert code == 0, err
    assert safetensors.torch.load_file(str(out))["blocks.5.attn.proj.weight"].isnan().sum() == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
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
    # a float64 weight beyond fp32's range: bf16 does not hold it either, so only leaving the cast out helps
    big64 = {k: v.double() for k, v in light_sd.items()}
    big64["module.blocks.5.attn.proj.weight"][3, 7] = 1e39
    torch.save({"model": big64}, src)
    for dtype in ("fp32", "bf16"):
        line = assert_one_line_error(*cli(capsys, "convert", src, out, "--dtype", dtype, "--overwrite", "--no-verify"))
        assert line.endswith(f"which the cast makes Inf; leave out --dtype {dtype}"), line


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_pickle_that_runs_code_is_refused_and_not_run(fmt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pth"
    torch.save(
        {"model": {"cls_token": torch.zeros(1, 1, 192), "x": _TouchOnLoad(marker)}},
        src,
        _use_new_zipfile_serialization=fmt == "zip",
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.safetensors"), "was not loaded")
    assert_one_line_error(*cli(capsys, "verify", src, src), "was not loaded")
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert folder_names(out_dir) == []
    # The payload is live: an unsafe load does run it.
    torch.load(src, weights_only=False)
    assert marker.exists()


def test_existing_output_without_overwrite(light_sd, tmp_path, capsys):
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"earlier result")
    assert_one_line_error(*cli(capsys, "convert", src, out), "exists; pass --overwrite")
    assert out.read_bytes() == b"earlier result"
    assert folder_names(tmp_path) == ["XXS24_224.pth", "out.safetensors"]
    code, _, err = cli(capsys, "convert", src, out, "--overwrite", "--no-verify")
    assert code == 0, err
    assert len(safetensors.torch.load_file(str(out))) == len(light_sd)
    assert folder_names(tmp_path) == ["XXS24_224.pth", "out.safetensors"]


def test_an_output_ending_in_a_slash_is_refused(light_sd, tmp_path, capsys):
    """``out.safetensors/`` names a folder, as ``cp`` reads it; a file of that name was written."""
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    for out in (f"{tmp_path}/out.safetensors/", f"{tmp_path}/out.pth/"):
        expect = f"output {out} ends in a slash, which names a folder; pass a file path such as {out[:-1]}"
        assert_one_line_error(*cli(capsys, "convert", src, out, "--no-verify", "--format", "safetensors"), expect)
        assert_one_line_error(*cli(capsys, "convert", src, out, "--no-verify"), expect)
    plot = f"{tmp_path}/gates.png/"
    assert_one_line_error(*cli(capsys, "inspect", src, "--plot", plot), f"such as {plot[:-1]}", stdout="")
    assert folder_names(tmp_path) == ["XXS24_224.pth"]


def test_output_under_a_file_is_refused(light_sd, tmp_path, capsys):
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    assert_one_line_error(*cli(capsys, "convert", src, blocker / "out.safetensors", "--no-verify"), str(blocker))
    assert folder_names(tmp_path) == ["XXS24_224.pth", "afile"] and blocker.read_text() == "not a folder"


def test_unwritable_output_folder(light_sd, tmp_path, capsys, monkeypatch):
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    out_dir = tmp_path / "ro"
    out_dir.mkdir()
    out_dir.chmod(0o500)
    try:
        if os.access(out_dir, os.W_OK):  # root writes anyway: let the permission check see what others would
            real_access = os.access

            def access(path, mode, *a, **k):
                if Path(path).resolve() == out_dir.resolve() and mode & os.W_OK:
                    return False
                return real_access(path, mode, *a, **k)

            monkeypatch.setattr(os, "access", access)
        assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.safetensors"), "not writable")
        assert folder_names(out_dir) == []
    finally:
        out_dir.chmod(0o700)


def test_output_folder_refusing_the_write(light_sd, tmp_path, capsys, monkeypatch):
    """The folder looks writable but creating the file fails (read-only mount, ACL)."""
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def refusing_open(path, mode, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckpt_save, "open", refusing_open, raising=False)
    assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.safetensors", "--no-verify"), "Permission denied")
    assert folder_names(out_dir) == []


class _InterruptAfter(dict):
    """A state dict that raises KeyboardInterrupt once ``n`` tensors have been read."""

    def __init__(self, sd, n: int, folder: Path, seen: list) -> None:
        super().__init__(sd)
        self.n, self.folder, self.seen = n, folder, seen

    def __getitem__(self, key):
        self.n -= 1
        if self.n < 0:
            self.seen += [p.stat().st_size for p in self.folder.iterdir()]
            raise KeyboardInterrupt
        return super().__getitem__(key)


def test_interrupted_safetensors_write_leaves_nothing(light_sd, tmp_path, capsys, monkeypatch):
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    seen: list[int] = []
    real = conversion.save_safetensors

    def save(path, sd, *a, **k):
        # Every tensor is read once, when it is written: stop mid-way.
        return real(path, _InterruptAfter(sd, len(sd) // 2, out_dir, seen), *a, **k)

    monkeypatch.setattr(conversion, "save_safetensors", save)
    assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.safetensors"), "interrupted", status=130)
    assert len(seen) == 1 and seen[0] > 10_000_000, "the interruption must hit a half-written temporary file"
    assert folder_names(out_dir) == []


def test_interrupted_pth_write_leaves_nothing(light_sd, tmp_path, capsys, monkeypatch):
    src = tmp_path / "XXS24_224.pth"
    _write("no-ema", src, light_sd)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real_save = torch.save

    def save(obj, f, *a, **k):
        if not isinstance(f, (str, os.PathLike)):  # the writer hands torch.save its open temporary file
            f.write(b"PK\x03\x04" + b"\0" * 4096)  # half a file, then the user hits Ctrl-C
            f.flush()
            assert [p.stat().st_size for p in out_dir.iterdir()] == [4100]
            raise KeyboardInterrupt
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    assert_one_line_error(*cli(capsys, "convert", src, out_dir / "out.pth"), "interrupted", status=130)
    assert folder_names(out_dir) == []


def test_interrupted_verification_removes_the_output(official, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "verify_state_dicts", interrupted)
    assert_one_line_error(*cli(capsys, "convert", official, tmp_path / "x.safetensors"), "interrupted", status=130)
    assert folder_names(tmp_path) == []


def test_unreadable_image_file_leaves_no_output(official, tmp_path, capsys, few_inputs):
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


# ---- remote sources: the right cache call, and a clear error offline ---------------------


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "torch-home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def _online(monkeypatch):
    """As if the network were up: offline mode off."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_https_source_goes_through_the_torch_hub_cache(official, tmp_path, torch_home, capsys, monkeypatch):
    import torch.hub

    _online(monkeypatch)

    calls = []

    def download(url, dst, hash_prefix=None, progress=True):
        calls.append((url, Path(dst), progress))
        shutil.copyfile(official, dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    url = "https://dl.fbaipublicfiles.com/deit/XXS24_224.pth"
    out = tmp_path / "out" / "x.safetensors"
    out.parent.mkdir()
    code, stdout, err = cli(capsys, "convert", url, out, "--no-verify", "--json")
    assert code == 0, err
    cached = torch_home / "hub" / "checkpoints" / "XXS24_224.pth"
    assert calls == [(url, cached, False)]  # no progress bar: stderr is not a terminal
    res = json.loads(stdout)
    assert res["model"] == MODEL and res["metadata"]["source_file"] == "XXS24_224.pth"
    assert res["source_sha256"] == hashlib.sha256(official.read_bytes()).hexdigest()

    # The second time the cached file is used; nothing is downloaded.
    code, _, err = cli(capsys, "convert", url, out, "--no-verify", "--overwrite")
    assert code == 0, err
    assert len(calls) == 1


def test_https_source_offline_is_one_line(tmp_path, torch_home, capsys, monkeypatch):
    import urllib.error

    import torch.hub

    def download(url, dst, hash_prefix=None, progress=True):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    _online(monkeypatch)

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    url = "https://dl.fbaipublicfiles.com/deit/XXS24_224.pth"
    assert_one_line_error(*cli(capsys, "convert", url, out_dir / "x.safetensors"), f"could not download {url}")
    assert folder_names(out_dir) == []
    assert not (torch_home / "hub" / "checkpoints" / "XXS24_224.pth").exists()


@pytest.fixture(scope="module")
def timm_hub_file(official, tmp_path_factory) -> Path:
    """A file as on timm's Hub repositories: plain safetensors, gamma layout, no prefix."""
    sd = torch.load(official, weights_only=True)["model"]
    path = tmp_path_factory.mktemp("hf-cache") / "model.safetensors"
    safetensors.torch.save_file({k.removeprefix("module."): v for k, v in sd.items()}, str(path))
    return path


@pytest.mark.parametrize(
    "source,repo,filename",
    [
        ("hf-hub:timm/cait_xxs24_224.fb_dist_in1k", "timm/cait_xxs24_224.fb_dist_in1k", "model.safetensors"),
        ("hf-hub:someone/cait-weights/xxs24/model.safetensors", "someone/cait-weights", "xxs24/model.safetensors"),
    ],
)
def test_hf_hub_source_goes_through_hf_hub_download(
    source, repo, filename, timm_hub_file, tmp_path, capsys, monkeypatch
):
    import huggingface_hub

    calls = []

    def download(repo_id, filename, *, revision=None, **kw):
        calls.append((repo_id, filename, revision))
        return str(timm_hub_file)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    out = tmp_path / "x.safetensors"
    code, stdout, err = cli(capsys, "convert", source, out, "--no-verify", "--json")
    assert code == 0, err
    assert calls == [(repo, filename, None)]
    res = json.loads(stdout)
    assert res["model"] == MODEL and res["source_layout"] == "gamma"
    assert res["metadata"]["source_file"] == "model.safetensors"


@pytest.mark.parametrize(
    "exc,offline,expect",
    [
        (
            "LocalEntryNotFoundError",
            False,
            "check the network",
        ),  # what hf_hub_download raises when the Hub is unreachable
        ("ConnectionError", False, "check the network"),
        ("LocalEntryNotFoundError", True, "HF_HUB_OFFLINE"),  # offline mode and nothing cached
    ],
)
def test_hf_hub_source_offline_is_one_line(exc, offline, expect, tmp_path, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(repo_id, filename, **kw):
        if exc == "ConnectionError":
            raise ConnectionError("[Errno 111] Connection refused")
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub.")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = cli(capsys, "convert", "hf-hub:timm/cait_xxs24_224.fb_dist_in1k", out_dir / "x.safetensors")
    assert_one_line_error(*result, "hf-hub:timm/cait_xxs24_224.fb_dist_in1k")
    assert expect in result[2]
    assert folder_names(out_dir) == []


def test_bad_hub_source_is_one_line(tmp_path, capsys):
    assert_one_line_error(*cli(capsys, "convert", "hf-hub:only-org", tmp_path / "x.safetensors"), "hf-hub:ORG/REPO")


# ---- the contract of every command -------------------------------------------------------


# ---- exit codes and the error prefix ------------------------------------------------------


def test_an_internal_error_exits_3_with_the_common_prefix(capsys, monkeypatch):
    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setitem(commands.COMMANDS, "list", broken)
    line = assert_one_line_error(
        *cli(capsys, "list"), status=3, expect="internal error: TypeError: unsupported operand"
    )
    assert "--debug" in line


def test_a_parity_failure_exits_1_from_any_command(capsys, monkeypatch):
    def failing(args):
        raise ParityError("converted model does not match cait_xxs24_224", parity_report(False))

    monkeypatch.setitem(commands.COMMANDS, "list", failing)
    assert_one_line_error(*cli(capsys, "list"), status=1, expect="does not match")


@pytest.mark.parametrize("argv", [["list"], ["--help"], ["convert", "--help"], ["--version"]])
@pytest.mark.parametrize("reader", ["left", "full device"])
def test_an_output_that_refuses_the_table(reader, argv, tmp_path):
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
    p = run_python_into(w, "-m", "timm_layerscale", *argv)
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


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_demo_into_a_folder_that_cannot_be_created_is_a_user_error(where, tmp_path, capsys):
    if where == "proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc on this system")
        out = Path("/proc/nope")
    else:
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "demo"
    code, stdout, err = cli(capsys, "demo", "--out", out)
    assert_one_line_error(code, stdout, err, f"writing {out} failed")
    assert stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{bad}.pth", "out.safetensors"],
        ["convert", "{official}", "{bad}.safetensors"],
        ["convert", "{official}", "{bad}.pth"],
        ["verify", "{official}", "{bad}.pth"],
        ["inspect", "{bad}.pth"],
        ["export", "{official}", "{bad}"],
        ["demo", "--out", "{bad}"],
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


_ARGUMENTS = """
import contextlib, io, json, runpy, sys
results = {}
for argv in (["verify", "a.pth", "b.safetensors", "--num-inputs", "-1"], ["verify", "a", "b", "--atol", "-1"],
             ["convert", "a", "b", "--rtol", "nan"], ["verify", "a", "b", "--num-inputs", "many"],
             ["export", "a", "b", "--num-inputs", "0"], ["verify", "a", "b", "--batch-size", "0"],
             ["verify", "a", "b", "--seed", str(2**64)], ["verify", "a", "b", "--seed", "1.5"]):
    sys.argv = ["timm-layerscale", *argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module("timm_layerscale", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    results[argv[-2] + " " + argv[-1]] = [code, err.getvalue()]
results["torch imported"] = "torch" in sys.modules
print(json.dumps(results))
"""


def test_bad_counts_and_tolerances_are_argument_errors_without_importing_torch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _ARGUMENTS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res.pop("torch imported") is False
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
        code, err = res[key]
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(ERROR) and text in err, (key, err)


def test_running_out_of_memory_is_one_line(official, tmp_path, capsys):
    """More seeded images than any machine holds (60 PB) end in one line that says what to do,
    not an internal error to report. A seed out of torch's range is refused by the options too."""
    from timm_layerscale.errors import LayerScaleError
    from timm_layerscale.parity.tolerance import VerifyOptions

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


def test_a_library_key_error_gives_no_command_line_advice():
    from timm_layerscale.conversion.keys import to_layerscale

    with pytest.raises(RemapError) as info:
        to_layerscale({"blocks.0.attn.rope.freqs": torch.ones(2)}, "cait")
    assert "--" not in str(info.value) and "check that the file is a checkpoint of this model family" in str(info.value)


# ---- inspect and export ---------------------------------------------------------------


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

    monkeypatch.setattr("timm_layerscale.files.read.read_state_dict", load)
    code, out, err = cli(capsys, "inspect", official, "--plot", plot)
    assert_one_line_error(code, out, err, f"output {plot} exists; pass --overwrite to replace it", stdout="")
    assert plot.read_bytes() == b"kept" and read == []  # refused before the checkpoint is read
    code, out, err = cli(capsys, "inspect", official, "--plot", tmp_path / "missing" / "gates.png")
    assert_one_line_error(code, out, err, "does not exist; create it or choose another output path", stdout="")
    monkeypatch.undo()
    assert cli(capsys, "inspect", official, "--plot", plot, "--overwrite")[0] == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_export_never_replaces_the_folder_that_holds_its_source(official, tmp_path, capsys, few_inputs):
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
def test_export_onto_a_link_replaces_the_folder_it_leads_to(official, tmp_path, capsys, few_inputs):
    real = tmp_path / "real"
    real.mkdir()
    (real / "old.txt").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, _, err = cli(capsys, "export", official, link, "--overwrite")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link stays, its folder is new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # nothing hidden left beside them
    assert (real / "model.safetensors").is_file() and not (real / "old.txt").exists()
    assert "timm-layerscale export XXS24_224.pth link\n" in (real / "README.md").read_text()  # the name typed


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
    dangling = tmp_path / "next.safetensors"
    dangling.symlink_to(real.parent / "next.safetensors")
    assert cli(capsys, "convert", official, dangling, "--no-verify")[0] == 0  # as open() creates it
    assert dangling.is_symlink() and (real.parent / "next.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "latest.safetensors",
        "model.safetensors",
        "next.safetensors",
        "next.safetensors",
        "runs",
    ]  # no temporary left in either folder


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "SOURCE", "out.safetensors"],
        ["convert", "SOURCE", "out.pth", "--to", "gamma"],
        ["inspect", "SOURCE", "--plot", "gates.png"],
    ],
    ids=["convert", "to-gamma", "inspect-plot"],
)
def test_an_output_that_is_a_pipe_or_a_device_is_never_replaced(official, tmp_path, capsys, argv):
    # Renaming a finished file onto /dev/null (as root) would replace the device for every process.
    pipe = tmp_path / argv[3 if argv[0] == "inspect" else 2]
    os.mkfifo(pipe)
    argv = [official if a == "SOURCE" else tmp_path / a if a == pipe.name else a for a in argv]
    code, out, err = cli(capsys, *argv, "--overwrite")
    message = f"output {pipe} is not a regular file (a device or a pipe); pass a file path"
    assert_one_line_error(code, out, err, message, stdout="")
    assert pipe.is_fifo() and [p.name for p in tmp_path.iterdir()] == [pipe.name]


# ---- convert --to gamma -----------------------------------------------------------------


def test_convert_to_gamma_on_the_command_line(official, tmp_path, capsys):
    ls = tmp_path / "ls.safetensors"
    assert cli(capsys, "convert", official, ls, "--no-verify")[0] == 0
    code, out, err = cli(capsys, "convert", ls, tmp_path / "official.pth", "--to", "gamma", "--no-verify")
    assert code == 0, err
    assert "(gamma layout, official file {'model': {'module.' + key: tensor}})" in out
    obj = torch.load(tmp_path / "official.pth", weights_only=True)
    assert list(obj) == ["model"] and all(k.startswith("module.") for k in obj["model"])

    code, out, err = cli(
        capsys, "convert", ls, tmp_path / "plain.pth", "--to", "gamma", "--plain", "--no-verify", "--json"
    )
    assert code == 0 and json.loads(out)["container"] == "plain"
    assert "blocks.0.gamma_1" in torch.load(tmp_path / "plain.pth", weights_only=True)

    code, out, err = cli(capsys, "convert", official, tmp_path / "again.pth", "--to", "gamma", "--no-verify")
    assert code == 0, err
    assert torch.load(tmp_path / "again.pth", weights_only=True)["model"].keys() == obj["model"].keys()


# ---- the command line that reproduces a run ---------------------------------------------


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


# ---- progress bars ----------------------------------------------------------------------


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


def test_no_progress_bars_when_stderr_is_not_a_terminal(official, tmp_path, capsys):
    assert not sys.stderr.isatty()
    code, _, err = cli(capsys, "convert", official, tmp_path / "x.safetensors", "--no-verify")
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


# ---- offline fails fast -----------------------------------------------------------------


def test_hf_hub_offline_fails_at_once_in_a_fresh_process(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TORCH_HOME=str(tmp_path / "torch"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for source in ("hf-hub:timm/cait_xxs24_224.fb_dist_in1k", "https://dl.fbaipublicfiles.com/deit/XXS24_224.pth"):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "timm_layerscale", "convert", source, str(tmp_path / "x.safetensors")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert time.perf_counter() - t0 < 10 + 5  # generous: a cold interpreter imports torch first
        assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "HF_HUB_OFFLINE is set")
    assert not (tmp_path / "x.safetensors").exists()


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


# ---- the model card ---------------------------------------------------------------------
