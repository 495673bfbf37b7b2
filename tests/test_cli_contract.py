"""The command line's contract: one exit-code table, one error prefix, user mistakes as user errors.

Exit status, for every command: 0 ok, 1 verification failed, 2 user error, 3 internal
error. Every error is one line on stderr starting with ``timm-layerscale: error:``.
Also here: what ``convert --to gamma`` writes, progress bars, failing fast offline, and
the model card's reference and citation.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import timm_layerscale  # noqa: F401  (registers the models)
from helpers import ERROR, ROOT, assert_one_line_error, cli, parity_report, run_python_into
from timm_layerscale import commands, progress
from timm_layerscale.converter import convert_checkpoint
from timm_layerscale.errors import ArchitectureError, ParityError, RemapError

MODEL = "cait_xxs24_224_ls"


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
    assert_one_line_error(code, stdout, err, f"cannot create {out}")
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
        "--num-inputs -1": "argument --num-inputs: must be at least 0, got -1",
        "--atol -1": "argument --atol: must be a finite number >= 0, got '-1'",
        "--rtol nan": "argument --rtol: must be a finite number >= 0, got 'nan'",
        "--num-inputs many": "argument --num-inputs: expected a whole number >= 0, got 'many'",
        "--num-inputs 0": "argument --num-inputs: 0 leaves no inputs; pass --images FILE ... too",
        "--batch-size 0": "argument --batch-size: must be at least 1, got 0",
        f"--seed {2**64}": f"argument --seed: must be from -2**63 to 2**64 - 1 (the seeds torch takes), got {2**64}",
        "--seed 1.5": "argument --seed: expected a whole number, got '1.5'",
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


def test_library_advice_is_said_as_options_on_the_command_line(tmp_path, capsys, official):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(Exception, match="pass overwrite=True to replace it"):
        convert_checkpoint(official, out, verify=False)
    assert_one_line_error(*cli(capsys, "convert", official, out), status=2, expect="pass --overwrite to replace it")
    assert out.read_bytes() == b"keep me"
    assert (
        commands.cli_message("closest is x; pass model='cait_s24_224_ls' to see")
        == "closest is x; pass --model cait_s24_224_ls to see"
    )
    assert commands.cli_message("or pass allow_nonfinite=True to convert") == "or pass --allow-nonfinite to convert"
    assert commands.cli_message("or pass fmt='pth'") == "or pass --format pth"
    assert commands.cli_message("pass atol=1e-5 to accept") == "pass --atol 1e-5 to accept"
    assert commands.cli_message("found embed_dim=192, depth=12") == "found embed_dim=192, depth=12"
    assert commands.cli_message("leave out to='gamma'") == "leave out --to gamma"
    assert (
        commands.cli_message("leave out create_pr=True or revision='dev'") == "leave out --create-pr or --revision dev"
    )


def test_conflicting_push_options_are_named_as_options(tmp_path, capsys):
    code, out, err = cli(capsys, "push", tmp_path, "my-org/model", "--create-pr", "--revision", "dev", "--dry-run")
    assert_one_line_error(code, out, err, "leave out --create-pr or --revision dev", stdout="")


def test_a_library_key_error_gives_no_command_line_advice():
    from timm_layerscale.conversion.keys import to_layerscale

    with pytest.raises(RemapError) as info:
        to_layerscale({"blocks.0.attn.rope.freqs": torch.ones(2)}, "cait")
    assert "--" not in str(info.value) and "check that the file is a checkpoint of this model family" in str(info.value)


def test_a_vit_tiny_like_deit3_file_is_told_the_nearest_width(tmp_path):
    import timm

    from timm_layerscale.conversion.detect import detect_variant
    from timm_layerscale.conversion.keys import to_gamma

    with torch.device("meta"):
        tiny = timm.create_model("vit_tiny_patch16_224", no_embed_class=True, init_values=1e-5)
    sd = to_gamma(tiny.state_dict(), "deit3")
    with pytest.raises(ArchitectureError) as info:
        detect_variant({"model": sd})
    msg = str(info.value)
    assert "embed_dim=192" in msg and "closest is deit3_small_patch16_224" in msg, msg
    assert "pass model='deit3_small_patch16_224'" in msg


# ---- inspect and export ---------------------------------------------------------------


def test_inspect_plot_without_matplotlib_fails_before_printing(official, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = cli(capsys, "inspect", official, "--plot", "gates.png")
    assert_one_line_error(code, out, err, "pip install 'timm-layerscale[plot]'")
    assert out == ""


def test_inspect_never_replaces_a_plot_without_overwrite(official, tmp_path, capsys, monkeypatch):
    from timm_layerscale import inspection

    plot = tmp_path / "gates.png"
    plot.write_bytes(b"kept")
    read: list[tuple] = []

    def load(*args) -> dict:
        read.append(args)
        return {}

    monkeypatch.setattr(inspection, "_load_state_dict", load)
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


def test_a_failed_export_leaves_no_folder_it_created(tmp_path):
    from timm_layerscale.hub.export import export_folder

    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"PK\x03\x04 not really a zip file")
    with pytest.raises(Exception, match="could not be read"):
        export_folder(bad, tmp_path / "hub" / "deeper" / "cait_xxs24_224_ls.fb_dist_in1k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pth"]


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
            return SimpleNamespace(summary=lambda: "done")

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
    progress.disable_progress_bars(False)


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


def _unresolvable(monkeypatch):
    def getaddrinfo(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize(
    "source", ["hf-hub:timm/cait_xxs24_224.fb_dist_in1k", "https://dl.fbaipublicfiles.com/deit/XXS24_224.pth"]
)
def test_no_name_resolution_fails_at_once(source, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    _unresolvable(monkeypatch)
    t0 = time.perf_counter()
    code, out, err = cli(capsys, "convert", source, tmp_path / "x.safetensors")
    assert time.perf_counter() - t0 < 10
    assert_one_line_error(code, out, err, "cannot resolve")
    assert "check the network" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []


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


def test_release_checks_network_and_token_before_converting(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    from convert.release import main as release

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    out = tmp_path / "release"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert release(["--out", str(out), "--only", "cait_xxs24_224"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m convert: error: HF_HUB_OFFLINE is set") and len(err.splitlines()) == 1

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("timm_layerscale.files.sources._resolves", lambda url: True)
    sources = tmp_path / "sources"
    sources.mkdir()
    assert release(["--out", str(out), "--sources", str(sources), "--org", "my-org"]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face token found" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-inputs", "0"], "argument --num-inputs: 0 leaves no inputs; pass --images FILE ... too"),
        (["--atol", "-1"], "argument --atol: must be a finite number >= 0, got '-1'"),
        (["--family", "vit"], "argument --family: invalid choice: 'vit' (choose from 'cait', 'deit3', 'vit5')"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_release_argument_errors_are_one_line(tmp_path, capsys, argv, message):
    from convert.release import main as release

    with pytest.raises(SystemExit) as e:
        release(["--out", str(tmp_path / "release"), *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"python -m convert: error: {message} (see 'python -m convert --help')\n"
    assert not (tmp_path / "release").exists()


# ---- the model card ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,reference,cites,not_cited",
    [
        ("cait_s24_224_ls", "cait_s24_224", "Going Deeper With Image Transformers", ("Revenge", "ViT-5")),
        ("deit3_small_patch16_224", "deit3_small_patch16_224", "Revenge of the {ViT}", ("Going Deeper", "ViT-5")),
        (
            "vit5_small_patch16_224",
            "vit5_official/vit5_small_patch16_224",
            "Vision Transformers for the Mid-2020s",
            ("Going Deeper", "Revenge"),
        ),
    ],
)
def test_model_card_names_its_reference_and_cites_its_family(name, reference, cites, not_cited, tmp_path):
    from timm_layerscale.conversion.detect import get_variant
    from timm_layerscale.hub.card import build_model_card

    report = parity_report(
        True, reference, name, family=get_variant(name).family, weights_equal=True, weights_compared=3
    )
    conversion = SimpleNamespace(
        variant=get_variant(name),
        source=str(tmp_path / "w.pth"),
        source_path=tmp_path / "w.pth",
        source_sha256="ab" * 32,
        source_layout="gamma",
        report=report,
    )
    config = {"architecture": name, "num_classes": 1000, "pretrained_cfg": {"input_size": [3, 224, 224]}}
    text = str(
        build_model_card(conversion, repo_id="org/x", config=config, num_params=1, command="timm-layerscale export a b")
    )
    ref_line = next(line for line in text.splitlines() if line.startswith("- **Reference:**"))
    if name.startswith("vit5"):
        assert "timm's" not in ref_line and "timm_layerscale.parity.vit5_official" in ref_line
        assert "timm has no ViT-5" in ref_line
    else:
        assert f"timm's `{reference}`" in ref_line
    citation = text.split("## Citation", 1)[1]
    assert "```bibtex" in citation and cites in citation and "%" not in citation
    assert not any(other in citation for other in not_cited)
