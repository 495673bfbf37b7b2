"""Writing checkpoints: contents, layout, round trips, interruptions, memory (timm_layerscale.files.save)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from helpers import (
    ALL_DTYPES,
    assert_aligned,
    assert_same_tensors,
    header_bytes,
    leftovers,
    make_tensor,
    mixed_state_dict,
    safetensors_contents,
)
from timm_layerscale.errors import CheckpointError, OutputExistsError
from timm_layerscale.files.read import load_checkpoint, nonfinite_tensors, parse_dtype
from timm_layerscale.files.save import output_format, save_pth, save_safetensors


def assert_matches_save_file(tmp: Path, tensors, metadata=None, **kwargs) -> None:
    """The header entries, metadata and tensor bytes of ``save_file``'s file, laid out aligned."""
    save_file(tensors, str(tmp / "ref.safetensors"), metadata=metadata)
    save_safetensors(tmp / "ours.safetensors", tensors, metadata, overwrite=True, **kwargs)
    assert safetensors_contents(tmp / "ours.safetensors") == safetensors_contents(tmp / "ref.safetensors")
    assert_aligned(tmp / "ours.safetensors")


@pytest.mark.compat
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_contents_equal_save_file_each_dtype(tmp_path, dtype):
    tensors = {"t": make_tensor((3, 5), dtype), "s": make_tensor((), dtype), "e": make_tensor((2, 0), dtype)}
    assert_matches_save_file(tmp_path, tensors)


def test_weight_matrices_start_on_64_byte_boundaries_before_the_rest(tmp_path):
    """A tensor of whole 64-byte blocks is never placed after an odd-sized one (a bias of 1000 classes)."""
    tensors = {"a.bias": torch.ones(1000), "b.weight": torch.ones(1000, 192), "c.bias": torch.ones(3)}
    tensors |= {"d.half": torch.ones(5, dtype=torch.float16), "e.weight": torch.ones(8, 4, dtype=torch.float16)}
    save_safetensors(tmp_path / "w.safetensors", tensors)
    assert_aligned(tmp_path / "w.safetensors")
    header = json.loads(header_bytes(tmp_path / "w.safetensors"))
    order = [n for n, _ in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])]
    assert order == ["b.weight", "e.weight", "a.bias", "c.bias", "d.half"]


def test_late_metadata_is_written_into_the_header_before_the_file_is_in_place(tmp_path):
    """Metadata known only after the tensors are written (a hash computed meanwhile) gives the
    file written with it from the start; one that would move the data is refused, nothing written."""
    tensors, out = mixed_state_dict(), tmp_path / "late.safetensors"
    seen = []

    def late():
        seen.append(out.exists())
        return {"sha": "f" * 64}

    save_safetensors(out, tensors, {"format": "pt", "sha": "0" * 64}, late_metadata=late)
    save_safetensors(tmp_path / "direct.safetensors", tensors, {"format": "pt", "sha": "f" * 64})
    assert seen == [False] and out.read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    with pytest.raises(ValueError, match="length"):
        save_safetensors(tmp_path / "x.safetensors", tensors, {"sha": ""}, late_metadata=lambda: {"sha": "f" * 64})
    assert leftovers(tmp_path) == [] and not (tmp_path / "x.safetensors").exists()


_NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__"
)


def test_cast_only_floating(tmp_path):
    tensors = mixed_state_dict()
    save_safetensors(tmp_path / "h.safetensors", tensors, dtype=torch.float16)
    cast = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(cast, str(tmp_path / "ref.safetensors"))
    assert safetensors_contents(tmp_path / "h.safetensors") == safetensors_contents(tmp_path / "ref.safetensors")


def test_views_and_shared_memory_written_as_copies(tmp_path):
    base = make_tensor((4, 6), torch.float32)
    tensors = {"t": base.t(), "row": base[1], "same": base, "alias": base}
    save_safetensors(tmp_path / "v.safetensors", tensors)
    copies = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(copies, str(tmp_path / "ref.safetensors"))
    assert safetensors_contents(tmp_path / "v.safetensors") == safetensors_contents(tmp_path / "ref.safetensors")


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="Linux's copy_file_range")
@pytest.mark.parametrize("source", ["pth", "safetensors"])
def test_mapped_tensors_are_copied_in_the_kernel_and_written_where_it_refuses(tmp_path, monkeypatch, source):
    """A mapped source's unchanged tensors go to the output by ``os.copy_file_range``, the rest (a cast, a view, a
    fresh tensor) from memory; where the copy fails, or the file of the mapping's name is not the mapped one, they are
    written from memory: the file is ``save_file``'s each time."""
    sd = {"a": make_tensor((64, 33), torch.float32), "b": make_tensor((7,), torch.bfloat16, 1)}
    if source == "pth":
        torch.save({"model": sd}, tmp_path / "src.pth")
    else:
        save_file(sd, str(tmp_path / "src.pth"))
    real, copied = os.copy_file_range, []

    def copy(*args):
        copied.append(args[2])
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", copy)
    mapped = load_checkpoint(tmp_path / "src.pth")
    mapped = mapped.get("model", mapped)
    tensors = {**mapped, "view": mapped["a"][:, 1], "fresh": torch.ones(3)}

    def check(dtype=None):  # the file save_file writes of the tensors cast as save_safetensors casts them
        cast = {k: v.to(dtype or v.dtype).contiguous().clone() if k != "b" else v.clone() for k, v in tensors.items()}
        save_file(cast, str(tmp_path / "ref.safetensors"))
        save_safetensors(tmp_path / "ours.safetensors", tensors, overwrite=True, dtype=dtype, keep=("b",))
        assert safetensors_contents(tmp_path / "ours.safetensors") == safetensors_contents(tmp_path / "ref.safetensors")

    check()
    assert sorted(copied) == [14, 64 * 33 * 4]  # a and b, each in one call
    check(torch.float16)  # a is cast: b alone is copied
    assert sorted(copied) == [14, 14, 64 * 33 * 4]

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    check()
    monkeypatch.setattr(os, "copy_file_range", copy)
    os.replace(tmp_path / "src.pth", tmp_path / "moved.pth")
    check()  # a rename is followed: the mapping names the file where it is now
    assert len(copied) == 5
    (tmp_path / "moved.pth").unlink()  # the mapping's name is now "moved.pth (deleted)": another file of that name
    (tmp_path / "moved.pth (deleted)").write_bytes(b"\0" * 9000)
    check()
    assert len(copied) == 5


def _save(path, sd, fmt, **kwargs):
    save = save_pth if output_format(path, fmt) == "pth" else save_safetensors
    save(path, sd, **kwargs)


@pytest.mark.compat
@pytest.mark.parametrize(
    "suffix, fmt", [(".safetensors", None), (".pth", None), (".pt", None), (".out", "pth"), (".out", "safetensors")]
)
def test_save_round_trip(tmp_path, suffix, fmt):
    sd = {f"t{i}": make_tensor((2, 3), dt, i) for i, dt in enumerate(ALL_DTYPES)}
    path = tmp_path / f"sd{suffix}"
    _save(path, sd, fmt)
    assert_same_tensors(load_checkpoint(path), sd)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_round_trip_with_cast(tmp_path, name, fmt):
    dtype = parse_dtype(name)
    sd = mixed_state_dict()
    _save(tmp_path / "c.bin", sd, fmt, dtype=dtype)
    loaded = dict(load_checkpoint(tmp_path / "c.bin"))
    for k, v in sd.items():
        expected = v.to(dtype) if v.is_floating_point() else v
        assert loaded[k].dtype == expected.dtype and torch.equal(loaded[k], expected), k


def test_save_pth_stores_views_compactly(tmp_path):
    big = torch.zeros(1000, 1000)
    save_pth(tmp_path / "v.pth", {"row": big[3]})
    assert (tmp_path / "v.pth").stat().st_size < 100_000
    assert torch.equal(load_checkpoint(tmp_path / "v.pth")["row"], big[3])


def test_output_format_rejects_unknown_format(tmp_path):
    with pytest.raises(CheckpointError, match="cannot tell the output format"):
        output_format(tmp_path / "x.npz")
    with pytest.raises(CheckpointError, match="unknown output format"):
        output_format(tmp_path / "x.pth", "onnx")


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        ({"a": 3}, None),
        ({"a": torch.empty(2, device="meta")}, None),
        ({"a": torch.ones(2).to_sparse()}, None),
        ({"a": torch.ones(1)}, {"epoch": 3}),
    ],
)
def test_save_rejects_unstorable_input(tmp_path, tensors, metadata):
    with pytest.raises(CheckpointError):
        save_safetensors(tmp_path / "x.safetensors", tensors, metadata)
    assert list(tmp_path.iterdir()) == []


def test_save_pth_rejects_non_tensors(tmp_path):
    with pytest.raises(CheckpointError, match="not a tensor"):
        save_pth(tmp_path / "x.pth", {"epoch": 3})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


class Interrupting(Mapping):
    """A state dict whose tensor reads raise ``error`` from the ``after``-th read on."""

    def __init__(self, tensors: dict[str, torch.Tensor], after: int, error: BaseException) -> None:
        self.tensors, self.after, self.error, self.reads = tensors, after, error, 0

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads += 1
        if self.reads > self.after:
            raise self.error
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_interrupted_save_pth_leaves_nothing(tmp_path, monkeypatch):
    def failing_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        save_pth(tmp_path / "x.pth", {"a": torch.ones(3)})
    assert list(tmp_path.iterdir()) == []


def test_full_disk_during_save_pth_is_one_line(tmp_path, monkeypatch):
    class Full:  # the file fills up after the first records
        def __init__(self, *args):
            self.written = 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(28, "No space left on device")
            return len(data)

    monkeypatch.setattr("timm_layerscale.files.save.CallbackIOWrapper", Full)
    with pytest.raises(CheckpointError, match=r"writing .*x\.pth failed \(No space left on device\)"):
        save_pth(tmp_path / "x.pth", {"a": torch.ones(10_000)})
    assert list(tmp_path.iterdir()) == []


def test_overwrite_refused_before_any_work(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    before = out.stat().st_mtime_ns
    watched = Interrupting({"a": torch.ones(1)}, after=10**9, error=RuntimeError())
    for save in (lambda: save_safetensors(out, watched), lambda: save_pth(out, watched)):
        with pytest.raises(OutputExistsError, match="exists; pass overwrite=True to replace it"):
            save()
    assert watched.reads == 0
    assert out.read_bytes() == b"keep me" and out.stat().st_mtime_ns == before
    save_safetensors(out, {"a": torch.ones(1)}, overwrite=True)
    assert torch.equal(load_checkpoint(out)["a"], torch.ones(1))


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="permissions do not bind root")
def test_unwritable_output_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            save_safetensors(locked / "x.safetensors", {"a": torch.ones(1)})
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_streaming_peak_anonymous_memory_about_one_tensor(tmp_path, dtype):
    """Writing a memory-mapped checkpoint holds about one tensor of the program's own memory: the
    source's pages are the page cache's (RssFile), not the program's (RssAnon)."""
    import threading
    import time

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) // 1024

    n, mib = 12, 8  # 96 MiB of float32 in 8 MiB tensors
    torch.save({f"w{i}": make_tensor((mib << 18,), torch.float32, i) for i in range(n)}, tmp_path / "big.pth")
    sd = load_checkpoint(tmp_path / "big.pth")  # memory-mapped
    save_safetensors(tmp_path / "warm.safetensors", {"warm-up": torch.ones(mib << 18)}, dtype=dtype)
    start, peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert nonfinite_tensors(sd) == []
        save_safetensors(tmp_path / "big.safetensors", sd, dtype=dtype)
    finally:
        done.set()
        sampler.join()
    assert peak[0] - start < 4 * mib, f"anonymous memory grew {peak[0] - start} MiB for a {n * mib} MiB file"
    saved = load_checkpoint(tmp_path / "big.safetensors")
    for k in ("w0", f"w{n - 1}"):
        assert torch.equal(saved[k], sd[k] if dtype is None else sd[k].to(dtype))
