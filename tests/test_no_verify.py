"""Conversion without verification: the same tensors as a verified one, the file's hash, the NaN/Inf check, no model run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors import safe_open

from helpers import gamma_file
from timm_layerscale import converter
from timm_layerscale.conversion.checkpoint import strip_prefixes, unwrap_state_dict
from timm_layerscale.files.read import load_checkpoint

#: A command line run in a fresh process, printing its exit code and whether it imported timm.
RUN = "import sys; from timm_layerscale.cli import main; print(main(sys.argv[1:]), 'timm' in sys.modules)"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


@pytest.fixture(scope="module")
def official_sd(official) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strip_prefixes(unwrap_state_dict(load_checkpoint(official))).items()}


def _official_file(path: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Path:
    torch.save(gamma_file({k: v.to(dtype) for k, v in sd.items()}, "cait"), path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.full
def test_same_tensors_as_the_verified_conversion(official_sd, tmp_path, dtype, few_inputs):
    src = _official_file(tmp_path / "XXS24_224.pth", official_sd, dtype)
    fast = converter.convert_checkpoint(src, tmp_path / "fast.safetensors", verify=False)
    checked = converter.convert_checkpoint(src, tmp_path / "checked.safetensors")
    fast_sd, fast_meta = read(fast.output)
    checked_sd, checked_meta = read(checked.output)
    assert list(fast_sd) == list(checked_sd)
    assert all(torch.equal(fast_sd[k], checked_sd[k]) and fast_sd[k].dtype == dtype for k in fast_sd)
    assert fast_meta["parity"] == "not verified" and checked_meta["parity"] == "bit-exact"
    same = {k for k in fast_meta if k in checked_meta and fast_meta[k] == checked_meta[k]}
    assert {"source_sha256", "source_file", "architecture", "source_layout", "target_layout"} <= same
    assert fast.source_sha256 == fast_meta["source_sha256"] == sha256(src)


def test_nonfinite_named_in_state_dict_order_and_allowed_on_request(tmp_path):
    sd = {"a": torch.randn(3000), "b.half": torch.randn(5000).half(), "c": torch.randn(40), "d": torch.randn(9000)}
    sd["d"] = sd["d"].bfloat16()
    sd["b.half"][4321] = float("inf")
    sd["d"][-1] = float("nan")
    sd["c"][0] = float("-inf")
    torch.save(sd, tmp_path / "bad.pth")
    from timm_layerscale.files.read import nonfinite_tensors

    assert nonfinite_tensors(load_checkpoint(tmp_path / "bad.pth")) == ["b.half", "c", "d"]


def test_large_finite_values_are_no_false_alarm(tmp_path):
    from timm_layerscale.files.read import nonfinite_tensors

    big = {"f32": torch.full((1000,), 3e38), "f16": torch.full((1000,), 60000.0).half()}
    big["bf16"] = torch.full((1000,), 3e38).bfloat16()
    torch.save(big, tmp_path / "big.pth")
    assert nonfinite_tensors(load_checkpoint(tmp_path / "big.pth")) == []


def test_conversion_without_verification_runs_no_model(official, tmp_path, capsys, monkeypatch):
    """The command line's no-verify conversion builds no reference and runs no model (detection builds the
    registered models on the meta device only)."""
    from helpers import cli
    from timm_layerscale.parity import references

    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(references, "build_loaded", refused)
    assert cli(capsys, "convert", official, tmp_path / "x.safetensors", "--no-verify")[0] == 0


def test_no_timm_once_the_shape_table_holds_the_variant(official, tmp_path, monkeypatch):
    """A conversion without verification reads the registered model's shapes from the shape table: the first run
    (in a fresh table) builds them with timm, a second imports no timm and writes the same file; the table's name
    changes with the package's source."""
    import subprocess
    import sys

    from helpers import ROOT
    from timm_layerscale import families

    monkeypatch.setenv("TIMM_LAYERSCALE_CACHE", str(tmp_path / "cache"))
    outs = [tmp_path / "cold.safetensors", tmp_path / "warm.safetensors"]
    for out, imported in zip(outs, ("True", "False"), strict=True):
        done = subprocess.run([sys.executable, "-c", RUN, "convert", str(official), str(out), "--no-verify", "-q"],
                              cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0 and done.stdout.split()[-1] == imported, done.stderr
    assert read(outs[0])[0].keys() == read(outs[1])[0].keys() and sha256(outs[0]) == sha256(outs[1])
    table = families.shape_table()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [table.name]
    source = Path(families.__file__)
    monkeypatch.setattr(Path, "stat", lambda p, **k: os.stat_result((0,) * 10) if p == source else os.stat(p, **k))
    assert families.shape_table() != table


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3_ls", "beit_base_patch16_224_ls"])
def test_buffers_an_official_file_stores_are_proven_without_timm(name, tmp_path, monkeypatch):
    """DINOv3's rotary periods and BEiT's relative position indices are proven computed by this package's formulas,
    equal to timm's (compared here): an official file of either converts without verification importing no timm,
    the buffers dropped by their proofs."""
    import subprocess
    import sys

    from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3
    from timm.models.beit import gen_relative_position_index

    from helpers import ROOT
    from timm_layerscale.demo import write_official_checkpoint
    from timm_layerscale.families import beit, dinov3

    for n in (8, 32, 64, 80, 128):
        assert torch.equal(dinov3.periods(n), cast(torch.Tensor, RotaryEmbeddingDinoV3(n, temperature=100).periods))
    for side in (1, 2, 7, 14, 24):
        assert torch.equal(beit.position_index(side), gen_relative_position_index((side, side)))
    monkeypatch.setenv("TIMM_LAYERSCALE_CACHE", str(tmp_path / "cache"))
    write_official_checkpoint(tmp_path / "timm.pth", name)
    converter.convert_checkpoint(tmp_path / "timm.pth", official := tmp_path / "official.pth", model=name,
                                 to="official", verify=False)  # fmt: skip
    saved = torch.load(official, weights_only=True)
    sd = saved.get("model", saved)
    key = next(k for k in sd if k.endswith(("periods", "relative_position_index")))
    sd[key] = sd[key] + 1  # other periods or another index: refused on their values
    torch.save(saved, bad := tmp_path / "bad.pth")
    for i, (source, code, said) in enumerate(((official, 0, ""), (official, 0, "ls layout"), (bad, 2, "computes"))):
        argv = ["convert", str(source), str(tmp_path / f"{source.stem}.safetensors"), "--model", name, "--no-verify"]
        done = subprocess.run(
            [sys.executable, "-c", RUN, *argv, "--overwrite"], cwd=ROOT, capture_output=True, text=True
        )
        printed = done.stdout.split()[-2:]  # the exit code, whether timm was imported: the first run may fill the table
        assert printed[0] == str(code) and (i == 0 or printed[1] == "False"), done.stderr
        assert said in done.stdout + done.stderr, done.stderr
        assert (f"{source.stem}.safetensors" in os.listdir(tmp_path)) == (code == 0)
    assert key not in read(tmp_path / "official.safetensors")[0]


def test_verify_waits_for_the_checksums_not_the_hash(official, tmp_path, monkeypatch):
    """A conversion hashes its source for the written file's metadata while checking its CRC-32s in the same pass;
    ``verify`` records nothing, so it checks the CRC-32s alone (a large file's SHA-256 would delay it)."""
    from timm_layerscale.files import read
    from timm_layerscale.parity.tolerance import VerifyOptions

    asked: list[bool] = []
    scan = read.scan_file

    def recorded(path: Path, digest: bool = True) -> str:
        asked.append(digest)
        return scan(path, digest)

    monkeypatch.setattr(read, "scan_file", recorded)
    converter.convert_checkpoint(official, converted := tmp_path / "ls.safetensors", verify=False)
    assert converter.verify_checkpoint(official, converted, options=VerifyOptions(num_inputs=1)).passed
    assert asked[0] and asked[1:] and not any(asked[1:]), asked  # verify: the checksums of each file alone


@pytest.mark.parametrize("text", ["[1]", "null", '{"x": 3}', '{"x": {"k": "s"}}', "{", "not json"])
def test_a_malformed_shape_table_is_rebuilt(text, tmp_path, monkeypatch, caplog):
    """A shape table of another shape, or one that does not parse, is rebuilt (a debug line says so) instead of
    crashing every command that runs detection; a folder in the table's place leaves no temporary behind."""
    from timm_layerscale import families

    monkeypatch.setenv("TIMM_LAYERSCALE_CACHE", str(tmp_path))
    families._shapes.cache_clear()
    table = families.shape_table()
    table.write_text(text)
    variant = families.get_variant("cait_xxs24_224_ls")
    with caplog.at_level("DEBUG", logger=families.__name__):
        shapes = families.state_dict_shapes(variant)
    assert shapes["blocks.0.ls1.gamma"] == (192,) and "rebuilding" in caplog.text
    assert json.loads(table.read_text())[f"{variant.name}/None/None"]["blocks.0.ls1.gamma"] == [192]
    families._shapes.cache_clear()
    table.unlink()
    table.mkdir()
    assert families.state_dict_shapes(variant) == shapes
    assert sorted(p.name for p in tmp_path.iterdir()) == [table.name]
    families._shapes.cache_clear()
