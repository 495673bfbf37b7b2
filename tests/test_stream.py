"""The one-pass conversion (timm_layerscale.conversion.stream): the same bytes, hash and errors as the general path."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from helpers import ALL_DTYPES, header_bytes, make_tensor
from timm_layerscale.conversion import io as ckpt
from timm_layerscale.conversion import pipeline, save, stream
from timm_layerscale.conversion.io import check_finite, load_checkpoint
from timm_layerscale.conversion.keys import official_checkpoint, strip_prefixes, unwrap_state_dict
from timm_layerscale.conversion.save import save_safetensors
from timm_layerscale.conversion.source_map import map_source
from timm_layerscale.conversion.stream import SourcePass
from timm_layerscale.errors import CheckpointError


def prepared(path: Path, sd: Mapping[str, torch.Tensor], check: bool = True) -> SourcePass:
    one = SourcePass.prepare(path, sd, check=check)
    assert one is not None, "no pass applies"
    return one


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mixed() -> dict[str, torch.Tensor]:
    """Every storable dtype, an empty and a 0-d tensor, and views that share one storage."""
    sd = {f"t.{dtype}".replace("torch.", ""): make_tensor((37, 3), dtype, i) for i, dtype in enumerate(ALL_DTYPES)}
    base = torch.randn(10, 8)
    sd.update({"rows.a": base[2:5], "rows.b": base[4:9], "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)})
    return sd


@pytest.fixture(params=["pth", "safetensors"])
def source(request, tmp_path) -> Path:
    path = tmp_path / f"src.{request.param}"
    if request.param == "pth":
        torch.save(mixed(), path)
    else:
        save_safetensors(path, {k: v.clone() for k, v in mixed().items()}, {"format": "pt"})
    return path


@pytest.fixture
def small_pieces(monkeypatch):
    """Read in 4 KiB pieces, so that tensors straddle pieces."""
    monkeypatch.setattr(stream, "_PIECE", 4096)


def test_copy_writes_the_bytes_of_save_safetensors(source, tmp_path, small_pieces):
    sd = load_checkpoint(source)
    one = prepared(source, sd)
    assert one.can_copy(sd)
    metadata = {"format": "pt", "note": "é"}
    digest = one.copy_to_safetensors(tmp_path / "fast.safetensors", sd, metadata, digest_key="sha")
    assert digest == metadata["sha"] == sha256(source)
    save_safetensors(tmp_path / "general.safetensors", sd, metadata)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "general.safetensors").read_bytes()


def test_copy_written_from_the_mapping_where_the_kernel_cannot_copy(source, tmp_path, small_pieces, monkeypatch):
    copies: list[int] = []

    def refused(src, dst, count, offset_src, offset_dst):
        copies.append(count)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", refused)
    sd = load_checkpoint(source)
    prepared(source, sd).copy_to_safetensors(tmp_path / "fast.safetensors", sd, {}, digest_key="sha")
    assert len(copies) == 1  # tried once, then written from the mapping
    save_safetensors(tmp_path / "general.safetensors", sd, {"sha": sha256(source)})
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "general.safetensors").read_bytes()


def test_hash_is_the_files(source, small_pieces):
    assert prepared(source, load_checkpoint(source)).run() == sha256(source)


@pytest.mark.parametrize("pieces", ["small", "large"])
def test_nonfinite_named_as_check_finite_names_it(tmp_path, monkeypatch, pieces):
    if pieces == "small":
        monkeypatch.setattr(stream, "_PIECE", 4096)
    sd = {
        "a": torch.randn(3000),
        "b.half": torch.randn(5000).half(),
        "c": torch.randn(40),
        "d.bf16": torch.randn(9000).bfloat16(),
    }
    sd["b.half"][4321] = float("inf")
    sd["d.bf16"][-1] = float("nan")
    sd["c"][0] = float("-inf")
    torch.save(sd, tmp_path / "bad.pth")
    loaded = load_checkpoint(tmp_path / "bad.pth")
    with pytest.raises(CheckpointError) as general:
        check_finite(loaded)
    with pytest.raises(CheckpointError) as fast:
        prepared(tmp_path / "bad.pth", loaded).run()
    assert (
        str(fast.value)
        == str(general.value)
        == (
            "3 tensor(s) contain NaN or Inf, first 'b.half'; check the source checkpoint, or pass allow_nonfinite=True to convert anyway"
        )
    )
    with pytest.raises(CheckpointError, match=r"first 'b\.half'"):
        prepared(tmp_path / "bad.pth", loaded).copy_to_safetensors(
            tmp_path / "x.safetensors", loaded, {}, digest_key="s"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pth"]  # nothing written, no temporary left
    allowed = prepared(tmp_path / "bad.pth", loaded, check=False)
    metadata: dict[str, str] = {}
    allowed.copy_to_safetensors(tmp_path / "x.safetensors", loaded, metadata, digest_key="s")
    save_safetensors(tmp_path / "y.safetensors", loaded, metadata)
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()


def test_sums_that_overflow_are_no_false_alarm(tmp_path):
    big = {
        "f32": torch.full((1000,), 3e38),
        "f16": torch.full((1000,), 60000.0).half(),
        "bf16": torch.full((1000,), 3e38).bfloat16(),
    }
    torch.save(big, tmp_path / "big.pth")
    assert prepared(tmp_path / "big.pth", load_checkpoint(tmp_path / "big.pth")).run() == sha256(tmp_path / "big.pth")


def test_where_no_pass_applies(tmp_path):
    t = torch.randn(4, 6)
    torch.save({"a": t}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert (
        SourcePass.prepare(tmp_path / "legacy.pth", load_checkpoint(tmp_path / "legacy.pth")) is None
    )  # read into memory
    torch.save({"a": t, "row": torch.randn(6)}, tmp_path / "zip.pth")
    sd = dict(load_checkpoint(tmp_path / "zip.pth"))
    assert map_source(tmp_path / "zip.pth", sd) is not None
    assert map_source(tmp_path / "zip.pth", {**sd, "copy": sd["a"].clone()}) is None  # a tensor in memory
    assert map_source(tmp_path / "zip.pth", {**sd, "t": sd["a"].t()}) is None  # not contiguous
    assert map_source(tmp_path / "zip.pth", {**sd, "wide": sd["row"].expand(3, 6)}) is None
    assert map_source(tmp_path / "zip.pth", {**sd, "n": 3}) is None
    assert map_source(tmp_path / "zip.pth", {"a": t}) is None  # not from this file
    one = prepared(tmp_path / "zip.pth", sd)
    assert one.can_copy(sd) and not one.can_copy(sd, torch.float16) and one.can_copy(sd, torch.float32)
    assert not one.can_copy({**sd, "extra": torch.ones(2)})


def test_a_tensor_changed_in_memory_is_not_taken_from_the_file(tmp_path):
    torch.save({"a": torch.ones(1 << 16), "b": torch.ones(1 << 16)}, tmp_path / "m.pth")
    sd = load_checkpoint(tmp_path / "m.pth")  # memory-mapped, copy-on-write
    assert map_source(tmp_path / "m.pth", sd) is not None
    sd["a"][5] = 3.0
    assert map_source(tmp_path / "m.pth", sd) is None and SourcePass.prepare(tmp_path / "m.pth", sd) is None


def test_a_source_that_grows_during_the_pass_is_refused(tmp_path):
    torch.save({"a": torch.randn(100)}, tmp_path / "s.pth")
    one = prepared(tmp_path / "s.pth", load_checkpoint(tmp_path / "s.pth"))
    with open(tmp_path / "s.pth", "ab") as f:
        f.write(b"more")
    with pytest.raises(CheckpointError, match="changed while it was being read"):
        one.run()


# --- through convert_checkpoint ------------------------------------------------------------------


@pytest.fixture
def general_path(monkeypatch):
    """Make convert_checkpoint take the path that reads the tensors through torch."""

    def use_general() -> None:
        monkeypatch.setattr(stream.SourcePass, "prepare", classmethod(lambda cls, *a, **k: None))

    return use_general


@pytest.fixture(scope="module")
def official_sd(official) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strip_prefixes(unwrap_state_dict(load_checkpoint(official))).items()}


def _official_file(path: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> Path:
    torch.save(official_checkpoint({k: v.to(dtype) for k, v in sd.items()}, "cait"), path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_conversion_bytes_equal_the_general_path(official_sd, tmp_path, general_path, dtype):
    src = _official_file(tmp_path / "XXS24_224.pth", official_sd, dtype)
    calls: list[Path] = []
    real = SourcePass.copy_to_safetensors

    def counted(self, output, *args, **kwargs):
        calls.append(output)
        return real(self, output, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SourcePass, "copy_to_safetensors", counted)
        fast = pipeline.convert_checkpoint(src, tmp_path / "fast.safetensors", verify=False)
    assert calls == [tmp_path / "fast.safetensors"]
    general_path()
    general = pipeline.convert_checkpoint(src, tmp_path / "general.safetensors", verify=False)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "general.safetensors").read_bytes()
    assert fast.source_sha256 == general.source_sha256 == sha256(src)
    assert json.loads(header_bytes(tmp_path / "fast.safetensors"))["__metadata__"]["source_sha256"] == sha256(src)


def test_safetensors_source_converts_in_one_pass(official, tmp_path, general_path):
    ls = pipeline.convert_checkpoint(official, tmp_path / "ls.safetensors", verify=False).output
    gamma = pipeline.convert_checkpoint(ls, tmp_path / "gamma.safetensors", to="gamma", verify=False).output
    fast = pipeline.convert_checkpoint(gamma, tmp_path / "fast.safetensors", verify=False)
    general_path()
    pipeline.convert_checkpoint(gamma, tmp_path / "general.safetensors", verify=False)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "general.safetensors").read_bytes()
    assert fast.source_sha256 == sha256(gamma)


def test_nonfinite_source_same_error_and_allow_nonfinite(official_sd, tmp_path, general_path):
    sd = dict(official_sd)
    sd["blocks.5.attn.proj.weight"] = sd["blocks.5.attn.proj.weight"].clone()
    sd["blocks.5.attn.proj.weight"][3, 7] = float("nan")
    sd["blocks.9.gamma_1"] = torch.full_like(sd["blocks.9.gamma_1"], float("inf"))
    src = _official_file(tmp_path / "XXS24_224.pth", sd, torch.float32)
    with pytest.raises(CheckpointError) as fast:
        pipeline.convert_checkpoint(src, tmp_path / "x.safetensors", verify=False)
    fast_allowed = pipeline.convert_checkpoint(src, tmp_path / "fast.safetensors", verify=False, allow_nonfinite=True)
    general_path()
    with pytest.raises(CheckpointError) as general:
        pipeline.convert_checkpoint(src, tmp_path / "x.safetensors", verify=False)
    assert str(fast.value) == str(general.value)
    assert str(fast.value).startswith("2 tensor(s) contain NaN or Inf, first 'blocks.5.attn.proj.weight';")
    pipeline.convert_checkpoint(src, tmp_path / "general.safetensors", verify=False, allow_nonfinite=True)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "general.safetensors").read_bytes()
    assert fast_allowed.source_sha256 == sha256(src)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("options", [{"fuse": True}, {"dtype": "bf16"}, {"fmt": "pth"}, {"to": "gamma", "fmt": "pth"}])
def test_other_outputs_hash_and_check_in_one_read_then_write(official, tmp_path, monkeypatch, options):
    """Where the output is no plain copy, the source is read once for hash and check, not twice."""
    source = official
    if options.get("to") == "gamma":
        source = pipeline.convert_checkpoint(official, tmp_path / "ls.safetensors", verify=False).output
    for name in ("sha256_file", "check_finite"):
        monkeypatch.setattr(ckpt, name, lambda *a, **k: pytest.fail("read the source again"))
    monkeypatch.setattr(SourcePass, "copy_to_safetensors", lambda *a, **k: pytest.fail("not a plain copy"))
    writes: list[Path] = []
    real = save.save_state_dict

    def counted(path, *args, **kwargs):
        writes.append(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(save, "save_state_dict", counted)
    suffix = ".pth" if options.get("fmt") == "pth" else ".safetensors"
    result = pipeline.convert_checkpoint(source, tmp_path / f"x{suffix}", verify=False, **options)
    assert result.source_sha256 == sha256(source) and writes == [tmp_path / f"x{suffix}"]


def test_conversion_without_verification_never_imports_timm(official, tmp_path):
    """The command line's no-verify conversion needs torch only: detection and key rules are timm-free."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "x.safetensors"
    argv = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "timm_layerscale",
        "convert",
        str(official),
        str(out),
        "--no-verify",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"torch", "timm_layerscale.conversion.stream"} <= imported  # the list shows what was imported
    assert sorted(m for m in imported if m == "timm" or m.startswith("timm.")) == []
