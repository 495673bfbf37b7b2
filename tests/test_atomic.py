"""A killed writer's temporary is removed by the next write of the same output, a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import ROOT, dead_pid, safetensors_contents
from timm_layerscale.errors import CheckpointError
from timm_layerscale.files import atomic as temporaries
from timm_layerscale.files.atomic import atomic_output, remove_stale_temporaries, temporary_folder
from timm_layerscale.files.save import save_safetensors, save_state_dict

POSIX = pytest.mark.skipif(sys.platform == "win32", reason="sends SIGKILL and takes flock")


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    return e


def temporaries_of(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp-"))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def big_tensors() -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.arange(4 << 20, dtype=torch.float32) + i for i in range(6)}  # 96 MiB


# The writer stops for good after its first tensor, with its temporary half written.
_SLOW_WRITER = """
import sys, time, torch
from pathlib import Path
from timm_layerscale.files.save import save_safetensors

out, ready = Path(sys.argv[1]), Path(sys.argv[2])
tensors = {f"blocks.{i}.w": torch.arange(4 << 20, dtype=torch.float32) + i for i in range(6)}

class Slow(dict):
    reads = 0
    def __getitem__(self, key):
        Slow.reads += 1
        if Slow.reads == len(self) + 2:  # every tensor was read once for the header, one was written
            ready.touch()
            time.sleep(600)
        return super().__getitem__(key)

save_safetensors(out, Slow(tensors))
"""


@POSIX
def test_temporary_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    out = tmp_path / "model.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(out), str(tmp_path / "ready")], env=env())
    try:
        wait_for(tmp_path / "ready", proc)
        (left,) = temporaries_of(out)
        assert left.startswith(f".model.safetensors.tmp-{proc.pid}-") and (tmp_path / left).stat().st_size > 16 << 20
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert temporaries_of(out) == [left] and not out.exists()  # what a kill leaves

    save_safetensors(out, big_tensors())
    assert temporaries_of(out) == []
    save_file(big_tensors(), tmp_path / "expected.safetensors")
    assert safetensors_contents(out) == safetensors_contents(tmp_path / "expected.safetensors")


# Holds a temporary of its own output, as a writer in the middle of its work does, until killed.
_LIVE_WRITER = """
import sys, time
from pathlib import Path
from timm_layerscale.files.atomic import atomic_output

out, ready = Path(sys.argv[1]), Path(sys.argv[2])
with atomic_output(out) as tmp:
    tmp.write_bytes(b"half")
    ready.write_text(tmp.name)
    time.sleep(600)
"""


@POSIX
def test_a_live_writers_temporary_is_left_alone(tmp_path):
    out = tmp_path / "model.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(out), str(tmp_path / "ready")], env=env())
    try:
        wait_for(tmp_path / "ready", proc)
        theirs = (tmp_path / "ready").read_text()
        save_safetensors(out, {"a": torch.ones(3)}, overwrite=True)  # another writer of the same output
        assert remove_stale_temporaries(out) == []
        assert temporaries_of(out) == [theirs] and (tmp_path / theirs).read_bytes() == b"half"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    save_safetensors(out, {"a": torch.ones(3)}, overwrite=True)
    assert temporaries_of(out) == []


# Locks a file of a given name and holds it: a live writer whatever the name says.
_LOCK_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
time.sleep(600)
"""


@POSIX
def test_the_lock_decides_and_the_pid_guards(tmp_path):
    out = tmp_path / "x.bin"
    dead = dead_pid()
    cases = {
        f".x.bin.tmp-{dead}-0a1b": True,  # writer gone, nothing holds it
        f".x.bin.tmp-{os.getpid()}-0a1b": True,  # this process's, and none of its writers holds it
        f".x.bin.tmp-{os.getppid()}-0a1b": False,  # its process still runs
        f".x.bin.tmp-{dead}-ffff": False,  # locked below by a live process
        ".x.bin.tmp-0a1b2c3d": False,  # not a name writers give
        f".y.bin.tmp-{dead}-0a1b": False,  # another output's
        f".x.bin.old-{dead}-0a1b": False,
    }
    for name in cases:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".x.bin.tmp-{dead}-0b").mkdir()  # a folder's temporary, with contents
    (tmp_path / f".x.bin.tmp-{dead}-0b" / "model.safetensors").write_bytes(b"x")
    cases[f".x.bin.tmp-{dead}-0b"] = True
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(tmp_path / f".x.bin.tmp-{dead}-ffff"), str(tmp_path / "locked")]
    )
    try:
        wait_for(tmp_path / "locked", holder)
        removed = remove_stale_temporaries(out)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in removed) == sorted(n for n, stale in cases.items() if stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["locked", *(n for n, stale in cases.items() if not stale)]
    )
    assert [p.name for p in remove_stale_temporaries(out)] == [f".x.bin.tmp-{dead}-ffff"]  # its holder is gone now


def test_without_locks_only_the_pid_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(temporaries, "fcntl", None)
    out = tmp_path / "x.bin"
    dead = dead_pid()
    for pid in (dead, os.getpid(), os.getppid()):
        (tmp_path / f".x.bin.tmp-{pid}-0a").write_bytes(b"x")
    assert [p.name for p in remove_stale_temporaries(out)] == [f".x.bin.tmp-{dead}-0a"]
    with atomic_output(out) as tmp:
        assert tmp.name.startswith(f".x.bin.tmp-{os.getpid()}-")
        tmp.write_bytes(b"done")
    assert out.read_bytes() == b"done"
    assert temporaries_of(out) == sorted(f".x.bin.tmp-{pid}-0a" for pid in (os.getpid(), os.getppid()))


def test_a_writer_in_this_process_keeps_its_temporary_from_another(tmp_path):
    out = tmp_path / "x.bin"
    with atomic_output(out, overwrite=True) as first:
        first.write_bytes(b"first")
        with atomic_output(out) as second:  # its clean-up must not take the first one's file
            second.write_bytes(b"second")
        assert first.read_bytes() == b"first"
    assert out.read_bytes() == b"first" and temporaries_of(out) == []


# Holds a temporary folder for an export into sys.argv[1] until killed.
_FOLDER_HOLDER = """
import sys, time
from pathlib import Path
from timm_layerscale.files.atomic import temporary_folder

tmp = temporary_folder(Path(sys.argv[1]))
(tmp / "model.safetensors").write_bytes(b"half")
Path(sys.argv[2]).write_text(tmp.name)
time.sleep(600)
"""


@POSIX
def test_temporary_folders_of_killed_exports_are_removed(tmp_path):
    out = tmp_path / "export"
    ready = tmp_path / "ready"
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen([sys.executable, "-c", _FOLDER_HOLDER, str(out), f"{ready}{i}"], env=env()))
            wait_for(Path(f"{ready}{i}"), procs[-1])
        killed, live = (Path(f"{ready}{i}").read_text() for i in range(2))
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert temporaries_of(out) == sorted([killed, live])
        mine = temporary_folder(out)
        assert temporaries_of(out) == sorted([live, mine.name])
        assert (tmp_path / live / "model.safetensors").read_bytes() == b"half"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    mine.rmdir()


# A real conversion on the command line, stopped for good in the middle of its write.
_STALLED_CONVERSION = """
import sys, time
from timm_layerscale.cli import main
from timm_layerscale.files import save

calls = []
real = save.release_pages

def stall(tensor):  # called once a tensor is written: the first is, then the conversion never ends
    calls.append(1)
    if len(calls) > 1:
        time.sleep(3600)
    real(tensor)

save.release_pages = stall
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--no-verify", "--quiet"]))
"""


def stalled_conversion(official: Path, out: Path) -> subprocess.Popen:
    """``timm-layerscale convert OFFICIAL OUT`` in a child process, stalled for good once its
    temporary holds the first tensor; its stderr is piped."""
    argv = [sys.executable, "-c", _STALLED_CONVERSION, str(official), str(out)]
    proc = subprocess.Popen(argv, env=env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not temporaries_of(out):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no temporary appeared: {proc.communicate()[1]}")
        time.sleep(0.01)
    time.sleep(0.2)
    return proc


@POSIX
def test_a_killed_conversion_leaves_nothing_after_the_next_one(official, tmp_path):
    from timm_layerscale.cli import main

    out = tmp_path / "cait_xxs24_224_ls.safetensors"
    proc = stalled_conversion(official, out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = temporaries_of(out)
    assert left and not out.exists()
    assert (tmp_path / left[0]).stat().st_size > 0  # the killed writer's partial file

    assert main(["convert", str(official), str(out), "--no-verify", "--quiet"]) == 0
    assert temporaries_of(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    (tmp_path / "reference").mkdir()
    reference = tmp_path / "reference" / out.name
    assert main(["convert", str(official), str(reference), "--no-verify", "--quiet"]) == 0
    assert out.read_bytes() == reference.read_bytes()


@POSIX
@pytest.mark.parametrize(
    "sig, status, said", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_terminated_conversion_cleans_up_on_its_way_out(official, tmp_path, sig, status, said):
    """SIGTERM (``kill``, ``timeout``, a scheduler's time limit) and Ctrl-C leave no temporary, unlike
    SIGKILL; the command says so in one line and exits 128 + the signal's number."""
    from timm_layerscale.cli import main

    out = tmp_path / "cait_xxs24_224_ls.safetensors"
    proc = stalled_conversion(official, out)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == status and err.strip() == f"timm-layerscale: error: {said}"
    assert list(tmp_path.iterdir()) == []
    before = signal.getsignal(signal.SIGTERM)
    assert main(["list"]) == 0 and signal.getsignal(signal.SIGTERM) is before  # put back after a command


@POSIX
def test_outputs_take_the_permissions_the_umask_gives(official, tmp_path, capsys, few_inputs):
    """A converted file and an exported folder are readable by whom the umask allows, like any file
    the user writes (a temporary made with ``mkstemp`` or ``mkdtemp`` would be the owner's only)."""
    import stat

    from helpers import cli

    old = os.umask(0o027)
    try:
        for name in ("a.safetensors", "a.pth"):
            assert cli(capsys, "convert", official, tmp_path / name, "--no-verify")[0] == 0
        assert cli(capsys, "export", official, tmp_path / "folder")[0] == 0
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes.pop("folder") == 0o750
    assert modes and set(modes.values()) == {0o640}, modes


@POSIX
def test_a_replaced_file_or_folder_keeps_its_permissions(official, tmp_path, capsys, few_inputs):
    """An output that replaces a file (``--overwrite``) or a folder (an empty one, or any with
    ``--overwrite``) takes that one's permissions, as writing into it would: what the user made
    private stays private; the umask decides only for what is new."""
    import stat

    from helpers import cli

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    private = tmp_path / "a.safetensors"
    private.write_bytes(b"old")
    private.chmod(0o600)
    assert cli(capsys, "convert", official, private, "--no-verify", "--overwrite")[0] == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    empty.chmod(0o700)
    assert cli(capsys, "export", official, empty)[0] == 0
    group = tmp_path / "group"
    assert cli(capsys, "export", official, group)[0] == 0
    group.chmod(0o750)
    assert cli(capsys, "export", official, group, "--overwrite")[0] == 0
    assert (mode(private), mode(empty), mode(group)) == (0o600, 0o700, 0o750)
    assert safetensors_contents(private) and (empty / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "empty", "group"]
    # while it is written, no one else may open it
    with atomic_output(private, overwrite=True) as tmp:
        assert mode(tmp) == 0o700
    assert mode(temporary_folder(group)) == 0o750


@POSIX
def test_a_link_put_in_place_of_a_temporary_is_not_followed(tmp_path, monkeypatch):
    """Whoever may write the output's folder can swap a temporary for a link to another file while
    it is written: its permissions and owner are set through a descriptor that no link leads on."""
    import stat

    victim = tmp_path / "victim"
    victim.write_text("someone's")
    victim.chmod(0o600)
    old = tmp_path / "old.safetensors"
    old.write_text("old")
    old.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(old, 12345, 23456)
    swapped = tmp_path / ".old.safetensors.tmp-1-abcd"
    swapped.symlink_to(victim)
    for writing in (True, False):
        temporaries.keep_mode(swapped, old, writing=writing)
    st = victim.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, os.geteuid(), os.getegid())

    # nor is it written through: the writers open the temporary without following a link
    def swap(new: Path, old: Path, writing: bool = False) -> None:
        new.unlink()
        new.symlink_to(victim)

    monkeypatch.setattr(temporaries, "keep_mode", swap)
    for out in (tmp_path / "out.safetensors", tmp_path / "out.pth"):
        with pytest.raises(CheckpointError, match=f"writing {out} failed"):
            save_state_dict(out, {"a": torch.ones(2)})
    assert victim.read_text() == "someone's" and not (tmp_path / "out.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["old.safetensors", swapped.name, "victim"])


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() != 0, reason="only root gives files away")
def test_what_root_replaces_stays_its_owners(official, tmp_path, capsys, few_inputs):
    """Root in a container, writing to a user's volume: a file (``--overwrite``) or a folder it
    replaces keeps that user and group, as writing into it would; a new one is root's."""
    from helpers import cli

    user = (12345, 23456)
    file = tmp_path / "a.safetensors"
    file.write_bytes(b"old")
    folder = tmp_path / "folder"
    folder.mkdir()
    for p in (file, folder):
        os.chown(p, *user)
    assert cli(capsys, "convert", official, file, "--no-verify", "--overwrite")[0] == 0
    assert cli(capsys, "export", official, folder)[0] == 0
    assert cli(capsys, "convert", official, tmp_path / "new.pth", "--no-verify")[0] == 0
    owners = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in tmp_path.iterdir()}
    assert owners == {"a.safetensors": user, "folder": user, "new.pth": (0, os.getegid())}
    assert safetensors_contents(file) and (folder / "model.safetensors").is_file()


def test_a_name_as_long_as_a_file_name_may_be(official, tmp_path, capsys, few_inputs):
    """A file name takes up to 255 bytes; the hidden siblings (``.NAME.tmp-PID-HEX``, an export's
    ``.NAME.old-HEX``) must fit too, and a killed writer's temporary is still found by the next."""
    from helpers import cli

    name = "a" * (255 - len(".safetensors")) + ".safetensors"
    assert cli(capsys, "convert", official, tmp_path / name, "--no-verify")[0] == 0
    folder = tmp_path / ("d" * 255)
    for overwrite in ([], ["--overwrite"]):
        code, _, err = cli(capsys, "export", official, folder, *overwrite)
        assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, folder.name])
    stale = tmp_path / f"{temporaries.hidden_prefix(tmp_path / name)}.tmp-{dead_pid()}-0123abcd"
    stale.write_bytes(b"half")
    assert remove_stale_temporaries(tmp_path / name) == [stale]
