"""Conversion under faults: a full disk, a mount point as export's folder, two writers racing for
one output, read-only folders, and a source that another process rewrites during the conversion.

Each fault is made real where this machine allows it (a small tmpfs, a read-only bind mount:
both need root and a ``mount`` that works, else those tests skip) and is also simulated by
patching the failing call, which always runs. The expectations are the command line's: one
line on stderr, a non-zero exit, no output and no temporary file left behind, the source
untouched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ERROR, ROOT, assert_one_line_error, cli, dead_pid
from timm_layerscale import converter as conversion
from timm_layerscale.conversion.detect import get_variant, state_dict_shapes
from timm_layerscale.conversion.keys import to_gamma
from timm_layerscale.errors import CheckpointError, OutputExistsError
from timm_layerscale.files import atomic
from timm_layerscale.files import read as ckpt
from timm_layerscale.files import save as ckpt_save
from timm_layerscale.files.atomic import atomic_output
from timm_layerscale.files.read import load_checkpoint

MODEL = "cait_xxs24_224_ls"


def light_checkpoint(path: Path, seed: int) -> Path:
    """An official-layout cait_xxs24_224 file whose tensors are broadcast rows (about 300 kB).

    Its conversion is the full 48 MB, which is what fills a small disk.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = to_gamma(state_dict_shapes(get_variant(MODEL)), "cait")
    sd = {"module." + k: torch.randn(s[-1], generator=gen).expand(s) for k, s in shapes.items()}
    torch.save({"model": sd}, path)
    return path


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    return light_checkpoint(folder / "XXS24_224.pth", seed=0)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def mounted(*args: str, target: Path, then_ro: bool = False):
    """``mount ARGS TARGET`` (and remount it read-only); skip the test where mounting is not allowed."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting needs root on Linux")
    target.mkdir(exist_ok=True)
    proc = _mount(*args, str(target))
    if proc.returncode != 0:
        pytest.skip(f"mount is not permitted here: {proc.stderr.strip()}")
    try:
        if then_ro:
            proc = _mount("-o", "remount,bind,ro", str(target))
            if proc.returncode != 0:
                pytest.skip(f"read-only remount is not permitted here: {proc.stderr.strip()}")
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


# --- disk full ----------------------------------------------------------------------------------


class _FillingFile:
    """A file that takes ``room`` bytes and then fails every write with ENOSPC, as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            self._f.write(memoryview(data).cast("B")[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def fill_disk(monkeypatch, folder: Path | None = None) -> None:
    """Every file the writers open for writing (in ``folder``, if given) takes 1 MiB, then ENOSPC."""
    real_open = open

    def filling_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if any(m in mode for m in "wa+") and (folder is None or Path(path).parent == folder):
            return _FillingFile(f, room=1 << 20)
        return f

    monkeypatch.setattr(ckpt_save, "open", filling_open, raising=False)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_disk_full_simulated(source, tmp_path, capsys, monkeypatch, suffix):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = sha256(source)
    fill_disk(monkeypatch, out_dir)
    code, out, err = cli(capsys, "convert", source, out_dir / f"x{suffix}", "--no-verify")
    assert_one_line_error(code, out, err, "No space left on device", stdout="")
    assert names(out_dir) == [] and sha256(source) == before


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_disk_full_on_a_small_tmpfs(source, tmp_path, capsys, suffix):
    before = sha256(source)
    with mounted("-t", "tmpfs", "-o", "size=8m", "tmpfs", target=tmp_path / "small") as small:
        code, out, err = cli(capsys, "convert", source, small / f"x{suffix}", "--no-verify")
        assert_one_line_error(code, out, err, "No space left on device", stdout="")
        assert names(small) == []
        assert os.statvfs(small).f_bfree == os.statvfs(small).f_blocks  # the space is free again
    assert sha256(source) == before


@pytest.mark.parametrize("failing", ["weights", "config", "card"])
def test_export_disk_full_at_each_file(source, tmp_path, capsys, monkeypatch, few_inputs, failing):
    """Whichever file of the folder meets the full disk, the error names the folder's path, not
    its temporary, and nothing is left: not the folder, not its temporary, not its parents."""
    import huggingface_hub

    from timm_layerscale.hub import export

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "weights":
        fill_disk(monkeypatch)
    elif failing == "config":
        monkeypatch.setattr(export, "write_config", full)
    else:
        monkeypatch.setattr(huggingface_hub.ModelCard, "save", full)
    out = tmp_path / "new" / "folder"
    code, stdout, err = cli(capsys, "export", source, out)
    assert_one_line_error(code, stdout, err, f"writing {out}", stdout="")
    assert "No space left on device" in err and ".tmp-" not in err
    assert names(tmp_path) == ["src"]


def test_demo_disk_full_simulated(tmp_path, capsys, monkeypatch):
    fill_disk(monkeypatch)
    code, out, err = cli(capsys, "demo", "--out", tmp_path / "demo")
    assert_one_line_error(code, out, err, f"writing {tmp_path / 'demo' / 'XXS24_224.pth'} failed")
    assert names(tmp_path) == []


def test_export_and_demo_on_a_full_tmpfs(source, tmp_path, capsys):
    with mounted("-t", "tmpfs", "-o", "size=8m", "tmpfs", target=tmp_path / "small") as small:
        code, out, err = cli(capsys, "export", source, small / "folder")
        assert_one_line_error(code, out, err, f"writing {small / 'folder' / 'model.safetensors'} failed", stdout="")
        assert names(small) == []
        code, out, err = cli(capsys, "demo", "--out", small / "demo")
        assert_one_line_error(code, out, err, "No space left on device")
        assert names(small) == []  # the demo's folder is removed with what it wrote
        (small / "empty").mkdir()
        code, out, err = cli(capsys, "demo", "--out", small / "empty")
        assert_one_line_error(code, out, err, "No space left on device")
        assert names(small) == ["empty"] and names(small / "empty") == []  # a folder it did not make stays
        assert os.statvfs(small).f_bfree == os.statvfs(small).f_blocks


def _write_into_volume(vol: Path, source: Path, capsys) -> None:
    """A mount point as export's DIR (a container's ``-v host:/out``), which no rename can replace
    or remove: filled (past the temporary a killed export left inside it), refused once it holds
    another file, its files replaced with --overwrite; then the demo's --out, with --overwrite."""
    (vol / f".{vol.name}.tmp-{dead_pid()}-0a1b2c3d").mkdir()
    code, _, err = cli(capsys, "export", source, vol, "--num-inputs", "1")
    assert (code, err) == (0, "")
    exported = names(vol)
    assert exported == ["README.md", "config.json", "gates.png", "model.safetensors"]
    (vol / "theirs.txt").write_text("x")
    assert_one_line_error(*cli(capsys, "export", source, vol, "--num-inputs", "1"), "exists and is not empty")
    code, _, err = cli(capsys, "export", source, vol, "--num-inputs", "1", "--overwrite")
    assert (code, err, names(vol)) == (0, "", exported)
    code, _, err = cli(capsys, "demo", "--out", vol, "--overwrite")
    assert (code, err, names(vol)) == (0, "", ["XXS24_224.pth", "cait_xxs24_224_ls.fb_dist_in1k"])


def test_export_and_demo_into_a_mount_point(source, tmp_path, capsys):
    with mounted("-t", "tmpfs", "-o", "size=256m", "tmpfs", target=tmp_path / "vol") as vol:
        _write_into_volume(vol, source, capsys)


def test_export_and_demo_into_a_mount_point_simulated(source, tmp_path, capsys, monkeypatch):
    vol = tmp_path / "vol"
    vol.mkdir()

    def busy(call):  # as the kernel refuses to rename or remove a mount point
        def refused(*args, **kwargs):
            if vol in (Path(a) for a in args[:2] if isinstance(a, (str, os.PathLike))):
                raise OSError(errno.EBUSY, "Device or resource busy", str(args[0]))
            return call(*args, **kwargs)

        return refused

    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == vol or is_mount(p))
    for name in ("rename", "replace", "rmdir"):
        monkeypatch.setattr(os, name, busy(getattr(os, name)))
    _write_into_volume(vol, source, capsys)


def test_export_into_a_folder_whose_parent_is_not_writable_simulated(source, tmp_path, capsys, monkeypatch):
    # /scratch/$USER in a /scratch the user cannot write: no sibling can be made, so the export is
    # built inside the folder, as in a mount point. Simulated: root may write anywhere.
    parent = tmp_path / "scratch"
    out = parent / "user"
    out.mkdir(parents=True)
    access, mkdir = os.access, os.mkdir

    def no_write_in_parent(path, mode, **kwargs):
        return not (Path(path) == parent and mode & os.W_OK) and access(path, mode, **kwargs)

    def refused_in_parent(path, *args, **kwargs):
        if Path(path).parent == parent:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "access", no_write_in_parent)
    monkeypatch.setattr(os, "mkdir", refused_in_parent)
    for overwrite in ([], ["--overwrite"]):
        code, _, err = cli(capsys, "export", source, out, "--num-inputs", "1", *overwrite)
        assert (code, err) == (0, "")
        assert names(out) == ["README.md", "config.json", "gates.png", "model.safetensors"]
        assert names(parent) == ["user"]


# --- two writers, one output ----------------------------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return [n for n in names(folder) if ".tmp-" in n]


def test_final_step_never_replaces_a_file_that_appeared(tmp_path, monkeypatch):
    """With the pre-checks out of the way, the hard link alone keeps the first writer's file."""
    monkeypatch.setattr(atomic, "check_output", lambda target, overwrite: None)
    out = tmp_path / "x.bin"
    out.write_bytes(b"first writer")
    with pytest.raises(OutputExistsError, match="exists; pass overwrite=True"), atomic_output(out) as tmp:
        tmp.write_bytes(b"second writer")
    assert out.read_bytes() == b"first writer" and _leftovers(tmp_path) == []
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"replacement")
    assert out.read_bytes() == b"replacement" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP])
def test_filesystem_without_hard_links_falls_back_to_rename(tmp_path, monkeypatch, code):
    def no_links(src, dst, *a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "x.bin"
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"data")
    assert out.read_bytes() == b"data" and _leftovers(tmp_path) == []


def test_interleaved_writers_one_wins(tmp_path):
    out = tmp_path / "x.bin"
    first, second = atomic_output(out), atomic_output(out)
    a, b = first.__enter__(), second.__enter__()  # both start while the output does not exist
    a.write_bytes(b"A" * 4096)
    b.write_bytes(b"B" * 4096)
    first.__exit__(None, None, None)
    with pytest.raises(OutputExistsError):
        second.__exit__(None, None, None)
    assert out.read_bytes() == b"A" * 4096 and _leftovers(tmp_path) == []


# Run the command line with the final step held until both processes reach it, so that
# they race for the output name at the same moment.
_RACER = """
import sys, time
from pathlib import Path
from timm_layerscale.files import atomic as checkpoint
from timm_layerscale.cli import main

barrier, me = Path(sys.argv[1]), sys.argv[2]
publish = checkpoint._publish

def held(tmp, target, overwrite):
    (barrier / me).touch()
    deadline = time.monotonic() + 300
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    publish(tmp, target, overwrite)

checkpoint._publish = held
sys.exit(main(sys.argv[3:]))
"""


def test_two_processes_converting_to_one_output(tmp_path):
    """Both pass every check, then race: exactly one writes the file, whole; the other says it exists."""
    sources = [light_checkpoint(tmp_path / f"XXS24_224_{i}.pth", seed=i) for i in (0, 1)]
    out_dir, barrier = tmp_path / "out", tmp_path / "barrier"
    out_dir.mkdir()
    barrier.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RACER,
                str(barrier),
                str(i),
                "convert",
                str(src),
                str(out_dir / "x.safetensors"),
                "--no-verify",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, src in enumerate(sources)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    assert names(barrier) == ["0", "1"], results  # both reached the final step
    codes = [r[0] for r in results]
    assert sorted(codes) == [0, 2], results
    winner, loser = codes.index(0), codes.index(2)
    lines = results[loser][2].splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR) and "exists; pass --overwrite" in lines[0], results[loser]
    assert names(out_dir) == ["x.safetensors"]
    alone = tmp_path / "alone" / "x.safetensors"
    alone.parent.mkdir()
    conversion.convert_checkpoint(sources[winner], alone, verify=False)
    assert (out_dir / "x.safetensors").read_bytes() == alone.read_bytes()


# --- read-only folders ----------------------------------------------------------------------------


def test_read_only_source_folder_mounted(source, tmp_path, capsys):
    before = sha256(source)
    with mounted("--bind", str(source.parent), target=tmp_path / "ro-src", then_ro=True) as ro:
        assert not os.access(ro, os.W_OK)
        out = tmp_path / "x.safetensors"
        code, stdout, err = cli(capsys, "convert", ro / source.name, out, "--no-verify")
        assert code == 0 and err == "", err
        assert len(stdout.splitlines()) == 1 and stdout.startswith("converted ")
        assert names(ro) == [source.name]
    assert load_checkpoint(out)["blocks.0.ls1.gamma"].shape == (192,)
    assert sha256(source) == before


def test_read_only_output_folder_mounted(source, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with mounted("--bind", str(out_dir), target=tmp_path / "ro-out", then_ro=True) as ro:
        assert_one_line_error(*cli(capsys, "convert", source, ro / "x.safetensors"), "not writable", stdout="")
        assert names(ro) == []


def test_read_only_source_folder_simulated(source, tmp_path, capsys, monkeypatch):
    """Every attempt to create or write a file beside the source fails, as on a read-only mount: none is made."""
    real_open, real_os_open = open, os.open
    attempts: list[str] = []

    def refuse(path) -> None:
        attempts.append(str(path))
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def guarded_open(path, mode="r", *args, **kwargs):
        if (
            isinstance(path, (str, os.PathLike))
            and Path(path).parent == source.parent
            and any(m in mode for m in "wax+")
        ):
            refuse(path)
        return real_open(path, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if Path(path).parent == source.parent and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", guarded_open, raising=False)
    monkeypatch.setattr(ckpt_save, "open", guarded_open, raising=False)
    monkeypatch.setattr(os, "open", guarded_os_open)
    out = tmp_path / "x.safetensors"
    code, stdout, err = cli(capsys, "convert", source, out, "--no-verify")
    assert code == 0 and err == "" and attempts == [], (err, attempts)
    assert stdout.startswith("converted ") and out.is_file()


def test_read_only_output_folder_simulated(source, tmp_path, capsys, monkeypatch):
    """The folder passes the permission check but creating the file fails with EROFS."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real_os_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if Path(path).parent == out_dir and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert_one_line_error(
        *cli(capsys, "convert", source, out_dir / "x.safetensors", "--no-verify"), "Read-only file system", stdout=""
    )
    assert names(out_dir) == []


# --- a source rewritten during the conversion --------------------------------------------------------

_REWRITE = {
    # Truncate and write again through the same inode, as torch.save(path) does.
    "in-place": "import sys; data = open(sys.argv[2], 'rb').read(); f = open(sys.argv[1], 'wb'); f.write(data); f.close()",
    # Write a new file and rename it over the source, as atomic writers do.
    "replaced": "import os, sys, shutil; shutil.copyfile(sys.argv[2], sys.argv[1] + '.new'); os.replace(sys.argv[1] + '.new', sys.argv[1])",
}


@pytest.mark.parametrize(
    "how,when,output",
    [
        ("in-place", "before-checking", "file"),
        ("replaced", "after-writing", "file"),
        ("replaced", "after-writing", "link"),
    ],
)
def test_source_rewritten_by_another_process(source, tmp_path, capsys, monkeypatch, how, when, output):
    # The rewrite runs while no mapped page of the source is being read: a file truncated under
    # a read of its mapping stops the process with SIGBUS, which no reader of mapped files survives.
    (tmp_path / "other").mkdir()
    other = light_checkpoint(tmp_path / "other" / source.name, seed=5)  # same name: the same size
    assert other.stat().st_size == source.stat().st_size and sha256(other) != sha256(source)

    def rewrite() -> None:
        subprocess.run([sys.executable, "-c", _REWRITE[how], str(source), str(other)], check=True)

    if when == "before-checking":  # the file is hashed meanwhile, in a second thread, with read()
        real_check = ckpt.check_finite

        def rewrite_then_check(*args, **kwargs):
            rewrite()
            return real_check(*args, **kwargs)

        monkeypatch.setattr(ckpt, "check_finite", rewrite_then_check)
    else:
        real_save = ckpt_save.save_state_dict

        def save_then_rewrite(*args, **kwargs):
            real_save(*args, **kwargs)
            rewrite()

        monkeypatch.setattr(ckpt_save, "save_state_dict", save_then_rewrite)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    if output == "link":  # a link that leads nowhere yet: the file written through it is removed, the link stays
        (tmp_path / "runs").mkdir()
        (out_dir / "x.safetensors").symlink_to(tmp_path / "runs" / "x.safetensors")
    code, out, err = cli(capsys, "convert", source, out_dir / "x.safetensors", "--no-verify")
    assert_one_line_error(code, out, err, "changed while it was being read", stdout="")
    if output == "link":
        assert names(tmp_path / "runs") == [] and (out_dir / "x.safetensors").is_symlink()
    else:
        assert names(out_dir) == []
    assert sha256(source) == sha256(other)  # the rewrite did happen


@pytest.mark.parametrize("overwrite", [["--overwrite"], []], ids=["overwrite", "no-overwrite"])
@pytest.mark.parametrize("output", ["the source", "a link to it", "the folder's weights"])
def test_output_that_is_the_source_is_refused(source, tmp_path, capsys, output, overwrite):
    # Without --overwrite too: advising --overwrite first would only lead to this refusal.
    if output == "the folder's weights":  # an exported folder is a source too
        folder = tmp_path / "folder"
        folder.mkdir()
        conversion.convert_checkpoint(source, folder / "model.safetensors", verify=False)
        source, target = folder, folder / "model.safetensors"
    elif output == "a link to it":
        target = tmp_path / "link.pth"
        target.symlink_to(source)
    else:
        target = source
    before = {p: sha256(p) for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = cli(capsys, "convert", source, target, "--to", "gamma", *overwrite, "--no-verify")
    assert_one_line_error(code, out, err, "is the source file itself; choose another output path", stdout="")
    assert {p: sha256(p) for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_hash_that_fails_after_the_write_leaves_no_output(source, tmp_path, capsys, monkeypatch, suffix):
    def failing(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(ckpt, "sha256_file", failing)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = cli(capsys, "convert", source, out_dir / f"x{suffix}", "--no-verify")
    assert_one_line_error(code, out, err, "Input/output error", stdout="")
    assert names(out_dir) == []


def test_unchanged_source_records_the_hash_of_its_bytes(source, tmp_path):
    result = conversion.convert_checkpoint(source, tmp_path / "x.safetensors", verify=False)
    assert result.source_sha256 == result.metadata["source_sha256"] == sha256(source)


def test_check_unchanged():
    with pytest.raises(CheckpointError, match="changed while it was being read"):
        ckpt.check_unchanged(Path("/nonexistent/file.pth"), None)
