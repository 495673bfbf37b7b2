"""Atomic outputs (timm_layerscale.files.atomic): a file or a folder appears whole or not at all, nothing is
replaced without overwrite, and the next write removes what a killed run left."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, dead_pid, leftovers
from timm_layerscale.errors import CheckpointError, OutputExistsError
from timm_layerscale.files.atomic import atomic_output, folder_output
from timm_layerscale.files.save import save_safetensors

ONE = {"a": torch.ones(3)}


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """A process killed mid-write leaves its temporary; the next write of that output removes it."""
    out = tmp_path / "model.safetensors"
    script = (
        "import os, sys; from pathlib import Path; from timm_layerscale.files.atomic import atomic_output\n"
        "with atomic_output(Path(sys.argv[1])) as tmp:\n    tmp.write_bytes(b'half'); os._exit(9)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", script, str(out)], env=env).returncode == 9
    (left,) = leftovers(tmp_path)
    other = tmp_path / ".other.safetensors.tmp-1-beef"  # another output's: not this one's to remove
    other.write_bytes(b"")
    save_safetensors(out, ONE)
    assert leftovers(tmp_path) == [other.name] and left.startswith(".model.safetensors.tmp-")


def test_which_temporaries_count_as_dead(tmp_path):
    """Gone processes' temporaries, and this pid's that this process did not open (every run in a
    container is pid 1), are removed; a live process's and this process's open one are kept."""
    out = tmp_path / "x.bin"
    names = {pid: f".x.bin.tmp-{pid}-abcd" for pid in (dead_pid(), os.getpid(), os.getppid())}
    for name in names.values():
        (tmp_path / name).write_bytes(b"")
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"mine")
        with atomic_output(tmp_path / "x.bin", overwrite=True) as again:  # a second writer of this process
            again.write_bytes(b"again")
        assert tmp.exists()
    assert leftovers(tmp_path) == [names[os.getppid()]] and out.read_bytes() == b"mine"


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
    assert (out / "a.txt").read_text() == "1" and leftovers(out) == []
    with folder_output(out, overwrite=True) as tmp:  # files this write does not make go at the end
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]


def test_a_folder_holding_only_dead_temporaries_counts_as_empty(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / f".export.tmp-{dead_pid()}-abcd").mkdir()
    with folder_output(out) as tmp:
        (tmp / "a.txt").write_text("1")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file"), folder_output(tmp_path / "file"):
        pass
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
