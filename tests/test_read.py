"""Reading checkpoints: formats, bad files, hashing, finite checks (timm_layerscale.files.read)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import assert_same_tensors, damage_inside, header_bytes, make_tensor, mixed_state_dict
from timm_layerscale.errors import CheckpointError
from timm_layerscale.files.read import check_finite, load_checkpoint, parse_dtype, scan_file


@pytest.mark.compat
def test_load_pth_zip_and_legacy(tmp_path):
    sd = mixed_state_dict()
    torch.save({"model": sd}, tmp_path / "new.pth")
    torch.save({"model": sd}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    for name in ("new.pth", "old.pth"):
        loaded = load_checkpoint(tmp_path / name)
        assert_same_tensors(loaded["model"], sd)


@pytest.mark.parametrize("suffix", [".pt", ".bin", ".ckpt", ".weights", ""])
def test_load_sniffs_format_when_suffix_unknown(tmp_path, suffix):
    sd = {"w": make_tensor((2, 2), torch.float32)}
    torch.save(sd, tmp_path / f"a{suffix}")
    assert_same_tensors(load_checkpoint(tmp_path / f"a{suffix}"), sd)
    save_file(sd, str(tmp_path / f"b{suffix}x"))
    assert_same_tensors(load_checkpoint(tmp_path / f"b{suffix}x"), sd)


def test_safetensors_load_mapped_in_file_order(tmp_path):
    sd = mixed_state_dict()
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    loaded = load_checkpoint(tmp_path / "m.safetensors")
    header = json.loads(header_bytes(tmp_path / "m.safetensors"))
    assert list(loaded) == [
        k for _, k in sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    ]
    assert_same_tensors(loaded, sd)


def _bad_files(tmp: Path) -> dict[str, Path]:
    sd = {"w": make_tensor((64, 64), torch.float32)}
    torch.save(sd, tmp / "good.pth")
    torch.save(sd, tmp / "legacy.pth", _use_new_zipfile_serialization=False)
    save_file(sd, str(tmp / "good.safetensors"))
    pth, legacy, sft = ((tmp / n).read_bytes() for n in ("good.pth", "legacy.pth", "good.safetensors"))
    files = {
        "empty.pth": b"",
        "truncated.pth": pth[: len(pth) // 2],
        "truncated_tail.pth": pth[:-5],
        "truncated_legacy.pth": legacy[:-100],
        "truncated.safetensors": sft[:-7],
        "truncated_header.safetensors": sft[:30],
        "tiny.safetensors": sft[:5],
        "text.pth": b"<html><body>404 Not Found</body></html>\n",
        "text.safetensors": b"model weights go here\n",
        "lfs.pth": b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n",
        "noise.pth": bytes(range(1, 256)) * 4,
        "noise.weights": bytes(range(1, 256)) * 4,
    }
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return {name: tmp / name for name in files}


@pytest.mark.parametrize(
    "name, message",
    [
        ("empty.pth", "is empty"),
        ("truncated.pth", "truncated or corrupt"),
        ("truncated_tail.pth", "truncated or corrupt"),
        ("truncated_legacy.pth", "truncated or corrupt"),
        ("truncated.safetensors", "not a valid safetensors file"),
        ("truncated_header.safetensors", "not a valid safetensors file"),
        ("tiny.safetensors", "not a valid safetensors file"),
        ("text.pth", "is a text file"),
        ("text.safetensors", "is a text file"),
        ("lfs.pth", "Git LFS pointer"),
        ("noise.pth", "neither a PyTorch nor a safetensors file"),
        ("noise.weights", "neither a PyTorch nor a safetensors file"),
    ],
)
def test_load_rejects_bad_files(tmp_path, name, message):
    path = _bad_files(tmp_path)[name]
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value) and ";" in str(info.value)


def test_load_rejects_missing_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pth")
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


@pytest.mark.compat
def test_checksums_find_a_file_damaged_inside(tmp_path):
    w = make_tensor((64, 64), torch.float32)
    torch.save({"w": w}, tmp_path / "good.pth")
    torch.save({"w": w}, tmp_path / "damaged.pth")
    damage_inside(tmp_path / "damaged.pth", w, 64)
    assert torch.load(tmp_path / "damaged.pth", weights_only=True)["w"].count_nonzero() < w.numel()  # torch loads it
    scan_file(tmp_path / "good.pth", digest=False)
    with pytest.raises(CheckpointError, match=r"damaged.pth is corrupt \(Bad CRC-32 for file '.*data/0'\); download"):
        scan_file(tmp_path / "damaged.pth", digest=False)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    scan_file(tmp_path / "w.safetensors", digest=False)  # no checksums to check
    for name in ("good.pth", "w.safetensors"):  # one pass gives the digest too
        assert scan_file(tmp_path / name) == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    with pytest.raises(CheckpointError, match=r"damaged.pth is corrupt \(Bad CRC-32 for file '.*data/0'\)"):
        scan_file(tmp_path / "damaged.pth")


def test_checksums_of_compressed_records(tmp_path):
    """A zip whose records are compressed (torch writes none) is checked through zipfile: damage is found."""
    with zipfile.ZipFile(tmp_path / "z.pth", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", bytes(range(256)) * 64)
    scan_file(tmp_path / "z.pth", digest=False)
    data = bytearray((tmp_path / "z.pth").read_bytes())
    with zipfile.ZipFile(tmp_path / "z.pth") as z:
        info = z.infolist()[0]
    data[info.header_offset + 30 + len(info.filename) + 2] ^= 1  # a byte inside the compressed stream
    (tmp_path / "bad.pth").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"bad\.pth is corrupt"):
        scan_file(tmp_path / "bad.pth", digest=False)


def test_checksums_skip_records_saved_without_one(tmp_path):
    save = pytest.importorskip("torch.utils.serialization").config.save
    save.compute_crc32 = False  # a config module: monkeypatch's undo would delete the option
    try:
        torch.save({"w": make_tensor((8, 8), torch.float32)}, tmp_path / "nocrc.pth")
    finally:
        save.compute_crc32 = True
    scan_file(tmp_path / "nocrc.pth", digest=False)


class _Payload:
    """Unpickling this would create a file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("legacy", [False, True])
def test_load_refuses_code_and_runs_none(tmp_path, legacy):
    marker = tmp_path / "created-by-unpickling"
    torch.save(
        {"model": {"w": torch.ones(1)}, "x": _Payload(str(marker))},
        tmp_path / "evil.pth",
        _use_new_zipfile_serialization=not legacy,
    )
    with pytest.raises(CheckpointError, match=r"contains code or objects that are not tensors.*was not loaded"):
        load_checkpoint(tmp_path / "evil.pth")
    assert not marker.exists()


@pytest.mark.parametrize("obj, kind", [([torch.ones(1)], "list"), (torch.ones(1), "Tensor"), (3, "int")])
def test_load_requires_top_level_dict(tmp_path, obj, kind):
    torch.save(obj, tmp_path / "x.pth")
    with pytest.raises(CheckpointError, match=f"holds a {kind}, not a dict"):
        load_checkpoint(tmp_path / "x.pth")


def test_check_finite():
    good = mixed_state_dict()
    check_finite(good, "f.pth", "do this")
    bad = dict(good)
    bad["blocks.0.gamma_1"] = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    bad["z"] = torch.tensor([float("inf")])
    with pytest.raises(CheckpointError, match=r"^f.pth: 2 tensor\(s\).*first 'blocks.0.gamma_1'; do this$"):
        check_finite(bad, "f.pth", "do this")


_NONFINITE_PROBE = """
import torch
from timm_layerscale.files.read import nonfinite_tensors

chunk = 1 << 24  # the check's chunk: a value just before, at and after its boundaries
cases = [(torch.float32, chunk + 40, (0, chunk - 1, chunk, chunk + 39))]
for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.complex64):
    cases.append((dtype, 4099, (0, 1, 15, 2048, 4097, 4098)))  # vector lanes and the scalar tail
missed = []
for dtype, n, places in cases:
    clean = torch.zeros(n, dtype=dtype)
    assert nonfinite_tensors({"x": clean}) == [], dtype
    for place in places:
        for value in (float("nan"), float("inf"), float("-inf")):
            x = clean.clone()
            x[place] = value if not dtype.is_complex else complex(0.0, value)
            if nonfinite_tensors({"x": x, "ok": clean}) != ["x"]:
                missed.append(f"{dtype} {value} at {place}/{n}")
print(missed)
"""


@pytest.mark.parametrize("dispatch", ["native", "default"])
@pytest.mark.full
def test_nonfinite_found_in_every_dtype_and_place_under_each_dispatch(dispatch):
    """NaN or Inf anywhere in a tensor of any floating dtype is found, wherever the vectorised
    kernels' lanes, tails and chunk boundaries put it, also under the scalar kernels."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if dispatch != "native":
        env["ATEN_CPU_CAPABILITY"] = dispatch
    proc = subprocess.run([sys.executable, "-c", _NONFINITE_PROBE], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_parse_dtype():
    assert [parse_dtype(n) for n in ("fp32", "fp16", "bf16")] == [torch.float32, torch.float16, torch.bfloat16]
    with pytest.raises(CheckpointError, match="use fp32, fp16 or bf16"):
        parse_dtype("int8")


def test_two_urls_of_one_file_name_never_share_a_download(monkeypatch, tmp_path):
    """Every Hub ``resolve/.../model.safetensors`` URL has one file name: each is kept under a hash of its URL, the
    user name and password left out."""
    from timm_layerscale.files.read import cached_url_path

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    a = cached_url_path("https://huggingface.co/org/a/resolve/main/model.safetensors")
    b = cached_url_path("https://huggingface.co/org/b/resolve/main/model.safetensors")
    assert a.name == b.name == "model.safetensors" and a != b and a.parent.parent == b.parent.parent
    assert cached_url_path("https://user:secret@example.org/w/S24.pth") == cached_url_path(
        "https://example.org/w/S24.pth"
    )


def test_a_sharded_checkpoint_reads_as_its_index_lists_it(tmp_path: Path) -> None:
    """A folder's index and its shards read as one mapped state dict; shards that disagree with their index, or an
    index naming a file elsewhere, are one line each."""
    from timm_layerscale.files.read import resolve_source

    tensors = {f"blocks.{i}.weight": torch.full((4,), float(i)) for i in range(5)}
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shards = {first: list(tensors)[:3], second: list(tensors)[3:]}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / name)
    weight_map = {k: name for name, keys in shards.items() for k in keys}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 80}, "weight_map": weight_map}))
    assert resolve_source(tmp_path) == index
    assert_same_tensors(load_checkpoint(tmp_path / "model.safetensors.index.json"), tensors)
    for wrong, expect in (
        ({"blocks.2.weight": second}, f"{first} holds 'blocks.2.weight', which {index.name} puts elsewhere"),
        ({"blocks.3.weight": first}, f"{first} lacks 'blocks.3.weight', which {index.name} puts there"),
    ):
        index.write_text(json.dumps({"weight_map": {**weight_map, **wrong}}))
        with pytest.raises(CheckpointError, match=re.escape(expect)):
            load_checkpoint(index)
    index.write_text(json.dumps({"weight_map": {**weight_map, "blocks.0.weight": "../model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names '../model.safetensors' as a shard, not a file beside it"):
        load_checkpoint(index)
