"""Atomic outputs (timm_layerscale.files.atomic): a file or a folder appears whole or not at all, nothing is
replaced without overwrite, and the next write removes what a killed run left."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, leftovers
from timm_layerscale.errors import CheckpointError, OutputExistsError
from timm_layerscale.files import atomic
from timm_layerscale.files.atomic import atomic_output, folder_output


def _holder(out: Path, folder: bool = False) -> subprocess.Popen:
    """Another process writing ``out`` (a file, or a folder), holding its temporary until it is killed."""
    writer = "folder_output(Path(sys.argv[1]))" if folder else "atomic_output(Path(sys.argv[1]))"
    script = (
        f"import sys, time; from pathlib import Path; from timm_layerscale.files.atomic import {writer.split('(')[0]}\n"
        f"with {writer} as tmp:\n    print(tmp, flush=True); time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", script, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline()  # its temporary exists and is locked
    return p


@pytest.mark.parametrize("folder", [False, True])
def test_a_living_writers_temporary_is_kept_and_a_dead_ones_removed(tmp_path, folder):
    """Two real processes: the lock of a writer that is alive keeps its temporary; once it is killed, the kernel
    drops the lock and the next write removes it, and no other output's. No lock file is left beside the output."""
    out, unrelated = tmp_path / ("export" if folder else "x.bin"), tmp_path / ".other.bin.tmp-beef"
    unrelated.write_bytes(b"")
    other = _holder(out, folder)
    try:
        with folder_output(out, overwrite=True) if folder else atomic_output(out, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("mine") if folder else tmp.write_bytes(b"mine")
        assert len(leftovers(tmp_path)) == 2  # the other writer's, still held, and another output's
    finally:
        other.kill()
        other.wait()
    with folder_output(out, overwrite=True) if folder else atomic_output(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("again") if folder else tmp.write_bytes(b"again")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, unrelated.name])


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_a_failed_write_leaves_what_was_there(tmp_path, error):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    expected = CheckpointError if error is OSError else KeyboardInterrupt
    match = "No space left" if error is OSError else None
    with pytest.raises(expected, match=match), atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"half")
        raise error(28, "No space left on device") if error is OSError else error()
    assert out.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_outputs_that_are_refused(tmp_path):
    (tmp_path / "taken").write_bytes(b"keep")
    with (
        pytest.raises(OutputExistsError, match="exists; pass overwrite=True to replace it"),
        atomic_output(tmp_path / "taken"),
    ):
        pass
    cases = {
        f"{tmp_path}/x.pth/": "ends in a slash, which names a folder",
        tmp_path: "is a directory",
        tmp_path / "missing" / "x.pth": "does not exist",
        os.devnull: "not a regular file",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message), atomic_output(path, overwrite=True):
            pass
    bad = os.fsdecode(b"\xff.pth")
    with pytest.raises(CheckpointError, match="not a UTF-8 name"), atomic_output(tmp_path / bad):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and (tmp_path / "taken").read_bytes() == b"keep"


def test_a_link_is_written_through_and_permissions_are_kept(tmp_path):
    real, link = tmp_path / "real.bin", tmp_path / "link.bin"
    real.write_bytes(b"old")
    real.chmod(0o600)
    link.symlink_to(real.name)
    with atomic_output(link, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
    assert link.is_symlink() and real.read_bytes() == b"new" and stat.S_IMODE(real.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    os.umask(umask)
    with atomic_output(tmp_path / "fresh.bin") as tmp:
        tmp.write_bytes(b"x")
    assert stat.S_IMODE((tmp_path / "fresh.bin").stat().st_mode) == 0o666 & ~umask


def test_a_folder_is_filled_whole_or_left_as_it_was(tmp_path):
    out = tmp_path / "parent" / "export"
    with pytest.raises(RuntimeError), folder_output(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError
    assert not out.exists()  # made for this write: gone again
    with folder_output(out) as tmp:
        (tmp / "a.txt").write_text("1")
        (tmp / "sub").mkdir()
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "sub"]
    with pytest.raises(OutputExistsError, match="exists and is not empty"), folder_output(out):
        pass
    with pytest.raises(KeyboardInterrupt), folder_output(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("2")
        raise KeyboardInterrupt
    assert (out / "a.txt").read_text() == "1" and leftovers(out.parent) == []
    with folder_output(out, overwrite=True) as tmp:  # files this write does not make go at the end
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]


_STEP = """
import os, shutil, sys
from pathlib import Path
from timm_layerscale.files import atomic
step, calls = int(sys.argv[2]), []
def stop(real):
    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            {stop}
        return real(*args, **kwargs)
    return call
atomic.os.replace = stop(os.replace)
atomic.shutil.rmtree = stop(shutil.rmtree)
with atomic.folder_output(Path(sys.argv[1]), overwrite=True) as tmp:
    (tmp / "model.safetensors").write_text("new")
    (tmp / "config.json").write_text("new")
"""


@pytest.mark.parametrize("kill", [False, True], ids=["interrupted", "killed"])
@pytest.mark.parametrize("step", [1, 2, 3], ids=["before-aside", "before-in-place", "before-old-removed"])
def test_an_interruption_at_each_step_of_the_swap_leaves_a_whole_export(tmp_path, step, kill):
    """Interrupted (Ctrl-C) or killed before each rename of the swap and before the old folder is removed: the
    folder is the complete old or the complete new export, at once or after the next write's recovery."""
    out = tmp_path / "export"
    out.mkdir()
    for name in ("model.safetensors", "config.json", "README.md"):
        (out / name).write_text("old")
    script = _STEP.replace("{stop}", "os._exit(9)" if kill else "raise KeyboardInterrupt")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", script, str(out), str(step)], env=env, capture_output=True)
    assert run.returncode != 0
    if kill:
        atomic.remove_stale(tmp_path, out.name)  # what the next write of the folder does first
    files = {p.name: p.read_text() for p in out.iterdir()}
    new = step == 3  # the new export was in place before the old one's removal began
    assert files == ({"model.safetensors": "new", "config.json": "new"} if new else dict.fromkeys(files, "old"))
    assert len(files) == (2 if new else 3) and leftovers(tmp_path) == []


def test_folders_that_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file"), folder_output(tmp_path / "file"):
        pass
    out = tmp_path / "export"
    out.mkdir()
    cwd = os.getcwd()
    os.chdir(out)
    try:
        with (
            pytest.raises(CheckpointError, match="is or holds the current folder"),
            folder_output(tmp_path, overwrite=True),
        ):
            pass
    finally:
        os.chdir(cwd)


_SLOW_WRITER = """
import sys, time
from pathlib import Path
from timm_layerscale.files.atomic import atomic_output, folder_output

kind, target, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
output = atomic_output(target) if kind == "file" else folder_output(target)
with output as tmp:
    (tmp / "model.bin" if kind == "folder" else tmp).write_text("first")
    print("written", flush=True)
    while not go.exists():  # the second writer finishes meanwhile
        time.sleep(0.01)
"""


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_of_two_writers_without_overwrite_only_one_places_its_output(tmp_path, kind):
    """Two real processes write one output without ``overwrite``: the one that finishes second is refused at the
    placing (an ``os.link`` onto a taken name, a rename onto a folder that is not empty), the first one's stays."""
    target, go = tmp_path / "out", tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, kind, str(target), str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert first.stdout is not None and first.stdout.readline() == "written\n"
    output = atomic_output(target) if kind == "file" else folder_output(target)
    with output as tmp:  # the second writer, start to end, while the first waits before placing its own
        (tmp / "model.bin" if kind == "folder" else tmp).write_text("second")
    go.touch()
    _, err = first.communicate(timeout=60)
    assert first.returncode != 0 and "OutputExistsError" in err and "appeared while this one was written" in err
    assert (target / "model.bin" if kind == "folder" else target).read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "out"]


@pytest.mark.parametrize("refusal", [errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.EMLINK])
def test_where_hard_links_are_refused_the_name_is_claimed_then_renamed_onto(tmp_path, monkeypatch, refusal):
    """A filesystem without hard links (vfat, exFAT, FUSE: ``link`` refused) still gets its output, placed by a rename
    onto a name claimed by an exclusive create: never onto a file that appeared meanwhile; a failed rename removes
    the claim, and a claim a killed run left (its lock free) is cleared by the next run."""

    def no_links(src, dst):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(atomic.os, "link", no_links)
    out = tmp_path / "out.bin"
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"new")
    assert out.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    with pytest.raises(OutputExistsError, match="appeared while"), atomic_output(tmp_path / "b.bin") as tmp:
        (tmp_path / "b.bin").write_bytes(b"theirs")  # another writer's output, placed meanwhile
    assert (tmp_path / "b.bin").read_bytes() == b"theirs"
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: no_links(a, b))
    refused = pytest.raises(CheckpointError, match=r"failed \(.+\); nothing was written, choose another path")
    with refused, atomic_output(tmp_path / "c.bin") as tmp:
        tmp.write_bytes(b"new")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "out.bin"]
    (tmp_path / "c.bin").write_bytes(atomic.CLAIM)  # a run killed after its claim, before its rename
    with atomic_output(tmp_path / "c.bin") as tmp:
        tmp.write_bytes(b"again")
    assert (tmp_path / "c.bin").read_bytes() == b"again"
