"""Verification one block at a time (``parity.stream``): the same outputs as the models held whole, bit for bit,
in every layout of every family, and the command that asks for it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_models
from timm_layerscale.conversion.rules import target_tensors, to_gamma, to_layerscale
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


def test_convert_streams_as_asked_in_a_fresh_process(official, tmp_path) -> None:
    argv = ["-m", "timm_layerscale", "convert", official, tmp_path / "out.safetensors", "--stream", "--json"]
    p = subprocess.run([sys.executable, *map(str, [*argv, "--num-inputs", "2"])], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)["report"]
    assert report["bit_exact"] and report["passed"] and report["weights_equal"]
    assert report["path"] == "one block at a time"


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
