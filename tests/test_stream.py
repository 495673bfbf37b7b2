"""Verification one block at a time (``parity.stream``): the same outputs as the models held whole, bit for bit,
in every layout of every family, and the command that asks for it."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_models
from helpers import cli
from timm_layerscale import progress
from timm_layerscale.conversion.rules import Cast, cast_tensors, target_tensors, to_gamma, to_layerscale
from timm_layerscale.families import Variant
from timm_layerscale.parity.inputs import seed_parameters_, seeded_inputs
from timm_layerscale.parity.references import build_reference, load_model, stream_model
from timm_layerscale.parity.stream import blocks_of

CPU = torch.device("cpu")


@torch.no_grad()
@pytest.mark.parametrize("v", tiny_models.TINY, ids=lambda v: v.name)
def test_streamed_outputs_equal_the_whole_models_in_every_layout(v: Variant, tiny_variants) -> None:
    gamma = to_gamma(seed_parameters_(build_reference(v, num_classes=0), seed=3).state_dict(), v.family)
    source = v.family.layouts[v.family.alias("pth")]  # backbones: some layouts hold no classifier
    files = {name: target_tensors(gamma, v, source, v.family.layouts[name]) for name in v.family.targets()}
    files[source.name] = gamma  # the file as its authors' code saves it, what its layout's rules drop and all
    batches = list(seeded_inputs(5, v.img_size, seed=1).split(2))  # a last batch of one: another operand shape
    forward: Any = (lambda m, x: m.forward_features(x)) if v.family.tokens else (lambda m, x: m(x))
    for name, tensors in files.items():
        layout = v.family.layouts[name]
        whole = load_model(v, layout, tensors, dtype=torch.bfloat16, num_classes=0)
        streamed = stream_model(v, layout, tensors, device=CPU, dtype=torch.bfloat16, num_classes=0)
        assert len(streamed.blocks) >= 2 and not any(
            p.device.type != "meta" for b in streamed.blocks for p in b.parameters()
        )
        expected = [forward(whole, x).float() for x in batches]
        got = streamed.run(batches, forward)
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name
        assert all(p.device.type == "meta" for b in streamed.blocks for p in b.parameters()), "freed after the run"


@torch.no_grad()
@pytest.mark.parametrize("v", tiny_models.TINY, ids=lambda v: v.name)
def test_a_cast_is_read_a_tensor_at_a_time_through_every_layouts_filter(v: Variant, tiny_variants, monkeypatch) -> None:
    gamma = to_gamma(seed_parameters_(build_reference(v, num_classes=0), seed=3).state_dict(), v.family)
    source = v.family.layouts[v.family.alias("pth")]
    batches = list(seeded_inputs(3, v.img_size, seed=1).split(2))
    forward: Any = (lambda m, x: m.forward_features(x)) if v.family.tokens else (lambda m, x: m(x))
    live, most, reads = [0], [0], collections.Counter[str]()
    read = Cast.__getitem__

    def counted(self: Cast, key: str) -> torch.Tensor:
        tensor = read(self, key)
        if tensor is self.tensors[key]:  # kept as it is
            return tensor
        reads[key] += 1
        live[0] += 1
        most[0] = max(most[0], live[0])
        weakref.finalize(tensor, lambda: live.__setitem__(0, live[0] - 1))
        return tensor

    for name in {source.name, *v.family.targets()}:
        layout = v.family.layouts[name]
        cast = cast_tensors(target_tensors(gamma, v, source, layout), torch.bfloat16, layout.computed(v))
        expected = [forward(load_model(v, layout, dict(cast), num_classes=0), x) for x in batches]
        with monkeypatch.context() as patch:
            patch.setattr(Cast, "__getitem__", counted)
            most[0] = 0
            reads.clear()
            got = stream_model(v, layout, cast, device=CPU, num_classes=0).run(batches, forward)
        assert all(torch.equal(a, b.float()) for a, b in zip(got, expected, strict=True)), name
        assert 0 < most[0] < len(cast) // 2, f"{name}: {most[0]} of {len(cast)} cast tensors held at once"
        assert max(reads.values()) <= 2, f"{name}: a tensor cast {max(reads.values())} times"  # checked, loaded


def test_a_transformers_model_streamed_says_it_was_loaded_whole(tiny_variants) -> None:
    from timm_layerscale import verify_checkpoint
    from timm_layerscale.parity.tolerance import VerifyOptions

    v = tiny_models.DINOV2
    gamma = to_gamma(seed_parameters_(build_reference(v, num_classes=0), seed=3).state_dict(), v.family)
    source = v.family.layouts[v.family.alias("pth")]
    converted = target_tensors(gamma, v, source, v.family.layouts["transformers"])
    report = verify_checkpoint(gamma, converted, model=v.name, options=VerifyOptions(num_inputs=2, stream=True))
    assert report.passed and report.path == "one block at a time (transformers' model loaded whole)"


def test_each_block_is_read_once_for_all_batches_of_a_group(tiny_variants, monkeypatch) -> None:
    v = tiny_models.DEIT3
    ls = to_layerscale(to_gamma(seed_parameters_(build_reference(v), seed=3).state_dict(), v.family), v.family)
    streamed = stream_model(v, v.family.layouts["ls"], ls, device=CPU)
    reads: list[int] = []
    load = streamed._load

    def counted(i: int) -> None:
        reads.append(i)
        load(i)

    monkeypatch.setattr(streamed, "_load", counted)
    done: list[int] = []
    outputs = streamed.run(list(seeded_inputs(7, v.img_size).split(2)), lambda m, x: m(x), done.append)
    assert len(outputs) == 4 and reads == done == list(range(len(streamed.blocks)))


def test_blocks_are_the_innermost_lists_of_like_modules() -> None:
    import timm

    with torch.device("meta"):
        cait, convnext = timm.create_model("cait_xxs24_224"), timm.create_model("convnext_atto")
    cait_blocks = [f"blocks.{i}" for i in range(24)] + ["blocks_token_only.0", "blocks_token_only.1"]
    assert [n for n, m in cait.named_modules() if m in blocks_of(cait)] == cait_blocks
    stage_blocks = [n for n, _ in convnext.named_modules() if re.fullmatch(r"stages\.\d\.blocks\.\d+", n)]
    assert [n for n, m in convnext.named_modules() if m in blocks_of(convnext)] == stage_blocks
    assert len(stage_blocks) == 2 + 2 + 6 + 2  # convnext_atto's depths


def test_a_failing_block_ends_the_lockstep_with_its_error(tiny_variants) -> None:
    v = tiny_models.CAIT
    ls = to_layerscale(to_gamma(seed_parameters_(build_reference(v), seed=3).state_dict(), v.family), v.family)
    streamed = stream_model(v, v.family.layouts["ls"], ls, device=CPU)
    streamed.blocks[1].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        streamed.run(list(seeded_inputs(4, v.img_size).split(2)), lambda m, x: m(x))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_convert_streams_as_asked_in_a_fresh_process(official, tmp_path, legacy: bool) -> None:
    """A cast as asked, read a block at a time; a legacy ``.pth``, which torch cannot map, read whole and said so."""
    if legacy:
        torch.save(torch.load(official), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
        official = tmp_path / "legacy.pth"
    argv = ["-m", "timm_layerscale", "convert", official, tmp_path / "out.safetensors", "--stream", "--json"]
    argv += ["--num-inputs", "2", "--dtype", "bf16"]
    p = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)["report"]
    assert report["bit_exact"] and report["passed"] and report["weights_equal"]
    whole = "; the source read whole, a legacy .pth: re-save it with torch.save to map it"
    assert report["path"] == "one block at a time" + (whole if legacy else "")


def test_a_streamed_check_shows_one_bar_over_blocks_and_images(official, tmp_path, capsys, monkeypatch) -> None:
    """On a terminal, one bar over image-blocks (26 blocks of each model, 2 images) with its rate; ``-q``: none."""
    monkeypatch.setattr(progress, "enabled", lambda: not progress._disabled)
    monkeypatch.setattr(progress, "DELAY", 0)
    monkeypatch.setattr(progress, "_disabled", False)
    argv = ["convert", official, tmp_path / "a.safetensors", "--stream", "--num-inputs", "2"]
    code, _, err = cli(capsys, *argv)
    assert code == 0 and re.search(r"verifying: .* \d+/104 .*image-block/s", err), err
    assert "batch" not in err  # the in-memory path's bar is not drawn beside it
    code, _, err = cli(capsys, *argv, "--overwrite", "-q")
    assert code == 0 and "image-block" not in err, err


@pytest.mark.slow  # a 13.4 GB file and two 7B forward passes: minutes, and 27 GB of disk
def test_the_7b_verifies_one_block_at_a_time(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_convert_7b import write_official

    source = tmp_path / "dinov3_vit7b16.safetensors"
    write_official(source, "vit_7b_patch16_dinov3_ls")
    argv = ["-m", "timm_layerscale", "convert", source, tmp_path / "out.safetensors", "--num-inputs", "1", "--json"]
    p = subprocess.run([sys.executable, *map(str, [*argv, "--stream"])], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)["report"]
    assert report["passed"] and report["weights_equal"] and report["path"] == "one block at a time"
