"""The mutation net: the bugs a converter really has, injected one at a time into tiny models of every family.

A wrong rule in one direction's table (two gates of a block swapped, two blocks' gates exchanged, a key dropped)
and a cast step that changes one gate element by 1%: ``convert`` and ``export`` never exit 0 and never leave
output. A wrong value or place exits 1 with the parity report, a dropped key exits 2 naming it; the clean run
passes. A file corrupted between its write and its read-back exits 1 too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import cli, damage_inside
from timm_layerscale import converter, families
from timm_layerscale.families import Family, Rule

ONE = ("--num-inputs", "1", "-q")


#: A gate's key in each target layout beyond ls and gamma (block b, gate i).
GATES = {
    ("dinov3", "official"): "blocks.{b}.ls{i}.gamma",
    ("dinov3", "transformers"): "layer.{b}.layer_scale{i}.lambda1",
    ("dinov2", "transformers"): "encoder.layer.{b}.layer_scale{i}.lambda1",
}
#: The dropped ``blocks.1.attn.proj.bias`` in the error of a target layout's model (transformers 5 names DINOv2's
#: ``attention.output.dense`` as it loads it).
DROPPED = {"transformers": {"dinov3": "layer.1.attention.o_proj.bias", "dinov2": "encoder.layer.1.attention."}}


def _rules(family: str, to: str, mutation: str) -> tuple[Rule, ...]:
    """The wrong rules put in front of the ``to`` direction's table."""
    src, dst = ("gamma_{i}", "blocks.{b}.ls{i}.gamma") if to == "ls" else ("ls{i}.gamma", "blocks.{b}.gamma_{i}")
    if family == "dinov2" and to in ("ls", "gamma"):  # the official file holds ls1.gamma too
        src, dst = "ls{i}.gamma", "blocks.{b}.ls{i}.gamma"
    dst = GATES.get((family, to), dst)

    def wrong(a: int, b: int, i: int, j: int) -> Rule:  # block a's gate i sent to block b's gate j
        return Rule(rf"blocks\.{a}\.{re.escape(src.format(i=i))}", dst.format(b=b, i=j))

    if mutation == "swap":  # the two gates of block 1 exchanged
        return (wrong(1, 1, 1, 2), wrong(1, 1, 2, 1))
    if mutation == "move":  # block 0's gates sent to block 1 and block 1's to block 0
        return tuple(wrong(a, b, i, i) for a, b in ((0, 1), (1, 0)) for i in (1, 2))
    return (Rule(r"blocks\.1\.attn\.proj\.bias", None),)  # "drop"


def _inject(patch: pytest.MonkeyPatch, family: str, to: str, mutation: str) -> None:
    """Inject ``mutation`` into the ``to`` direction of ``family``'s conversion, undone with ``patch``."""
    if mutation == "cast":
        real = converter.cast_tensors

        def cast(tensors, dtype, family):
            out = real(tensors, dtype, family)
            key = next(k for k in out if k.endswith(("ls1.gamma", "gamma_1", "layer_scale1.lambda1")))
            out[key] = out[key].clone()
            out[key][0] *= 1.01
            return out

        patch.setattr(converter, "cast_tensors", cast)
    elif mutation != "clean":
        fam, wrong = families.FAMILIES[family], _rules(family, to, mutation)
        if to in ("ls", "gamma"):
            table = "to_layerscale" if to == "ls" else "to_gamma"
            changed = Family(**{**fam.__dict__, table: (*wrong, *getattr(fam, table))})
        else:
            targets = tuple((name, (*wrong, *rules) if name == to else rules) for name, rules in fam.targets)
            changed = Family(**{**fam.__dict__, "targets": targets})
        patch.setitem(families.FAMILIES, family, changed)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Per family: an official-layout file (the source of ``--to ls``) and its ``ls`` conversion (of ``--to gamma``)."""
    import tiny_models
    from timm_layerscale import to_gamma, to_layerscale
    from timm_layerscale.conversion.keys import official_checkpoint
    from timm_layerscale.parity.inputs import seed_parameters_
    from timm_layerscale.parity.references import build_reference

    folder, out = tmp_path_factory.mktemp("mutation-net"), {}
    for v in tiny_models.TINY:
        sd = to_gamma(seed_parameters_(build_reference(v), seed=1).state_dict(), v.family)
        out[v.family, "ls"] = folder / f"{v.family}.pth"
        torch.save(official_checkpoint(sd, v.family), out[v.family, "ls"])
        out[v.family, "gamma"] = folder / f"{v.family}_ls.pth"
        torch.save(to_layerscale(sd, v.family), out[v.family, "gamma"])
        for to in ("official", "transformers"):  # from the ls layout, without the classifier these have no place for
            out[v.family, to] = folder / f"{v.family}_backbone.pth"
            torch.save(
                {k: t for k, t in to_layerscale(sd, v.family).items() if not k.startswith("head.")}, out[v.family, to]
            )
    return out


#: Each mutation and the exit status it must end with.
EXPECTED = {"clean": 0, "swap": 1, "move": 1, "drop": 2, "cast": 1}


def _assert_refused(mutation: str, code: int, out: str, err: str, *outputs: Path, dropped: str = "") -> None:
    assert code == EXPECTED[mutation], (mutation, code, err)
    assert all(not p.exists() for p in outputs) or mutation == "clean", f"{mutation} left output"
    if mutation == "drop":
        assert (dropped or "blocks.1.attn.proj.bias") in err, err
    elif mutation != "clean":
        assert "FAIL" in out and "nothing written" in err, (out, err)


CASES = [
    (f, to, d) for f in ("cait", "deit3", "vit5", "dinov3", "dinov2") for to in ("ls", "gamma") for d in (None, "bf16")
]
CASES += [("dinov3", "official", None), ("dinov3", "transformers", None), ("dinov2", "transformers", None)]


@pytest.mark.parametrize(("family", "to", "dtype"), CASES)
def test_convert_refuses_every_mutation(family, to, dtype, sources, tiny_variants, tmp_path, capsys):
    for mutation in EXPECTED:
        with pytest.MonkeyPatch.context() as patch:
            _inject(patch, family, to, mutation)
            out, extra = tmp_path / f"{mutation}.pth", ("--dtype", dtype) if dtype else ()
            code, stdout, err = cli(capsys, "convert", sources[family, to], out, "--to", to, *extra, *ONE)
        _assert_refused(mutation, code, stdout, err, out, dropped=DROPPED.get(to, {}).get(family, ""))


@pytest.mark.parametrize(
    ("family", "to"),
    [("cait", "ls"), ("cait", "gamma"), ("deit3", "ls"), ("vit5", "ls"), ("dinov3", "ls"), ("dinov2", "ls")],
)
def test_export_refuses_every_mutation(family, to, sources, tiny_variants, tmp_path, capsys):
    for mutation in EXPECTED:
        with pytest.MonkeyPatch.context() as patch:
            _inject(patch, family, "ls", mutation)
            folder = tmp_path / mutation
            code, stdout, err = cli(capsys, "export", sources[family, "ls"], folder, "--to", to, *ONE)
        _assert_refused(mutation, code, stdout, err, folder)
        assert mutation != "clean" or (folder / "model.safetensors").is_file()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_file_damaged_between_write_and_read_back_is_refused(suffix, sources, tiny_variants, tmp_path, capsys):
    """The weight check reads the written file back: damage there exits 1, and nothing is put in place."""
    from timm_layerscale.files.read import load_checkpoint

    real = converter._check_written

    def damaged(written, *args):
        gate = next(v for k, v in load_checkpoint(written).items() if k.endswith("ls2.gamma"))
        damage_inside(written, gate.clone())
        real(written, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(converter, "_check_written", damaged)
        out = tmp_path / f"model{suffix}"
        code, stdout, err = cli(capsys, "convert", sources["cait", "ls"], out, *ONE)
    assert code == 1 and not out.exists() and not list(tmp_path.iterdir()), err
    assert "the written file differs from the source" in err and "NOT all equal" in stdout
