"""The mutation net: the bugs a converter really has, injected one at a time into tiny models of every family.

A wrong rule in one direction's table (two gates of a block swapped, two blocks' gates exchanged, a key dropped)
and a cast step that changes one gate element by 1%: ``convert`` and ``export`` never exit 0 and never leave
output. A wrong value or place exits 1 with the parity report, a dropped key exits 2 naming it; the clean run
passes. A file corrupted between its write and its read-back exits 1 too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from helpers import cli, damage_inside, gamma_file
from timm_layerscale import converter, families
from timm_layerscale.families import Rule

ONE = ("--num-inputs", "1", "-q")


#: A gate's key in each target layout whose gates do not sit in ``blocks.N`` (block b, gate i).
GATES = {
    ("dinov3", "official"): "blocks.{b}.ls{i}.gamma",
    ("dinov3", "transformers"): "layer.{b}.layer_scale{i}.lambda1",
    ("dinov2", "transformers"): "encoder.layer.{b}.layer_scale{i}.lambda1",
}
#: The dropped ``blocks.1.attn.proj.bias`` in the error of a target layout's model (transformers 5 names DINOv2's
#: ``attention.output.dense`` as it loads it).
DROPPED = {"transformers": {"dinov3": "layer.1.attention.o_proj.bias", "dinov2": "encoder.layer.1.attention."}}
DROPPED["transformers"] |= {"convnext": "stages.2.", "beit": "layers.1.attention.o_proj.bias"}
DROPPED |= {to: {"convnext": "stages.2."} for to in ("ls", "gamma", "official", "from:official", "from:transformers")}
DROPPED["from:dinov3"] = DROPPED["ls"]
GATES |= {("convnext", "transformers"): "", ("beit", "transformers"): "encoder.layer.{b}.lambda_{i}"}
#: A family's bias that the drop mutation loses, read (the source's name) and written (the ls name), where it is not
#: ``blocks.1.attn.proj.bias``.
DROP = {("resmlp", True): r"blocks\.1\.attn\.bias", ("resmlp", False): r"blocks\.1\.linear_tokens\.bias"}
for to in ("ls", "gamma", "timm"):
    DROPPED.setdefault(to, {})["resmlp"] = "blocks.1.linear_tokens.bias"
#: Reading a layout other than the one ``gamma`` names (``to`` ``from:LAYOUT``): a block's gate ``i`` and the bias
#: the drop mutation loses, in that layout's names.
READS = {
    "beit:transformers": (r"encoder\.layer\.{a}\.lambda_{i}", r"encoder\.layer\.1\.attention\.output\.dense\.bias"),
    "internvit:": (r"encoder\.layers\.{a}\.ls{i}", r"encoder\.layers\.1\.attn\.proj\.bias"),
}
GATES |= {("internvit", to): "encoder.layers.{b}.ls{i}" for to in ("gamma", "official")}
GATES[("internvit", "transformers")] = "encoder.layer.{b}.lambda_{i}"
GATES[("pe", "official")] = "transformer.resblocks.{b}.ls_{i}.gamma"
DROPPED["transformers"]["internvit"] = "encoder.layer.1.attention.projection_layer.bias"
DROPPED["gamma"]["internvit"] = "encoder.layers.1.attn.proj.bias"


def _gate_names(family: str, to: str) -> tuple[str, str]:
    """Templates of gate ``i``'s key (in block ``b``) read and written by the ``to`` direction, from the family's
    gate records: the file's layout names it raw (``gamma_{i}``, ResMLP's timm ``ls{i}``) or as a module."""
    fam = families.FAMILIES[family]
    side = fam.alias("pth") if to in ("ls", "gamma") else to.removeprefix("from:")
    raw = {g.name: g.raw.get(side, f"{g.name}.gamma") for g in fam.gates}
    in_file = raw["ls1"].replace("1", "{i}")  # gamma_1, gamma1, ls1, ls1.gamma
    if to == "ls" or to.startswith("from:"):
        return in_file, "blocks.{b}.ls{i}.gamma"
    return "ls{i}.gamma", GATES.get((family, to), "blocks.{b}." + in_file)


def _rules(family: str, to: str, mutation: str) -> tuple[Rule, ...]:
    """The wrong rules put in front of the ``to`` direction's table (``from:LAYOUT``: reading LAYOUT)."""
    if family == "convnext":  # one gate a block: swapped with the block's norm weight, or moved between blocks
        return _convnext_rules(to, mutation)
    reading = to == "ls" or to.startswith("from:")
    src, dst = _gate_names(family, to)
    default_drop = DROP.get((family, reading), r"blocks\.1\.attn\.proj\.bias")
    gate, drop = READS.get(f"{family}:{to[5:]}" * reading, (r"blocks\.{a}\." + src.replace(".", r"\."), default_drop))

    def wrong(a: int, b: int, i: int, j: int) -> Rule:  # block a's gate i sent to block b's gate j
        return Rule(gate.format(a=a, i=i), dst.format(b=b, i=j))

    if mutation == "swap":  # the two gates of block 1 exchanged
        return (wrong(1, 1, 1, 2), wrong(1, 1, 2, 1))
    if mutation == "move":  # block 0's gates sent to block 1 and block 1's to block 0
        return tuple(wrong(a, b, i, i) for a, b in ((0, 1), (1, 0)) for i in (1, 2))
    return (Rule(drop, None),)  # "drop"


_STAGE = (r"stages\.2\.blocks\.{}\.", "stages.2.blocks.{}.")
#: ConvNeXt's stage-2 block (a pattern, a template), its gate, norm weight and MLP output bias in each layout.
_CONVNEXT = {
    "timm": (*_STAGE, "gamma", "norm.weight", "mlp.fc2.bias"),
    "ls": (*_STAGE, "ls.gamma", "norm.weight", "mlp.fc2.bias"),
    "official": (r"stages\.2\.{}\.", "stages.2.{}.", "gamma", "norm.weight", "pwconv2.bias"),
    "transformers": (r"encoder\.stages\.2\.layers\.{}\.", "encoder.stages.2.layers.{}.", "layer_scale_parameter",
                     "layernorm.weight", "pwconv2.bias"),
    "dinov3": (r"stages\.2\.layers\.{}\.", "stages.2.layers.{}.", "gamma", "layer_norm.weight", "pointwise_conv2.bias"),
}  # fmt: skip


def _convnext_rules(to: str, mutation: str) -> tuple[Rule, ...]:
    """ConvNeXt's wrong rules in stage 2 (two blocks of one width), reading timm's layout (``to="ls"``) or another
    (``from:LAYOUT``), or writing a layout (``gamma``: timm's)."""
    reading = to == "ls" or to.startswith("from:")
    src, dst = (
        (_CONVNEXT[to[5:] or "timm"], _CONVNEXT["ls"])
        if reading
        else (_CONVNEXT["ls"], _CONVNEXT[{"gamma": "timm"}.get(to, to)])
    )

    def wrong(a: int, b: int, what: int, into: int) -> Rule:  # block a's gate (2) or norm (3) sent to block b's
        return Rule(src[0].format(a) + re.escape(src[what]), dst[1].format(b) + dst[into])

    if mutation == "swap":
        return (wrong(1, 1, 2, 3), wrong(1, 1, 3, 2))
    if mutation == "move":
        return (wrong(0, 1, 2, 2), wrong(1, 0, 2, 2))
    return (Rule(src[0].format(1) + re.escape(src[4]), None),)


#: How a first gate's key ends in any layout: modules, raw parameters, transformers' names.
GATE_ENDINGS = (
    "ls1.gamma",
    "gamma_1",
    "gamma1",
    ".ls1",
    "ls.gamma",
    "0.gamma",
    "lambda1",
    "lambda_1",
    "_parameter",
    "ls_1.gamma",
)


def _inject(patch: pytest.MonkeyPatch, family: str, to: str, mutation: str) -> None:
    """Inject ``mutation`` into the ``to`` direction of ``family``'s conversion, undone with ``patch``: reading the
    source's layout (``to="ls"``), or writing the layout ``to`` names."""
    if mutation == "cast":
        real = converter.cast_tensors

        def cast(tensors, dtype, keep):
            out = dict(real(tensors, dtype, keep))
            key = next(k for k in out if k.endswith(GATE_ENDINGS))
            out[key] = out[key].clone()
            out[key][0] *= 1.01
            return out

        patch.setattr(converter, "cast_tensors", cast)
    elif mutation != "clean":
        fam, wrong = families.FAMILIES[family], _rules(family, to, mutation)
        name = fam.alias("pth") if to in ("ls", "gamma") else to.removeprefix("from:").replace("dinov3", "transformers")
        layout = fam.layouts[name]
        if to == "ls" or to.startswith("from:"):
            changed = dataclasses.replace(layout, read=(*wrong, *layout.read))
        else:
            changed = dataclasses.replace(layout, write=(*wrong, *layout.write))
        for key, value in fam.layouts.items():
            if value is layout:
                patch.setitem(fam.layouts, key, changed)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Per family: an official-layout file (the source of ``--to ls``) and its ``ls`` conversion (of ``--to gamma``)."""
    import tiny_models
    from timm_layerscale import to_gamma, to_layerscale
    from timm_layerscale.conversion.rules import target_tensors
    from timm_layerscale.parity.inputs import seed_parameters_
    from timm_layerscale.parity.references import build_reference

    folder, out = tmp_path_factory.mktemp("mutation-net"), {}
    for v in tiny_models.TINY:
        sd = to_gamma(seed_parameters_(build_reference(v), seed=1).state_dict(), v.family)
        out[v.family.name, "ls"] = folder / f"{v.family.name}.pth"
        torch.save(gamma_file(sd, v.family), out[v.family.name, "ls"])
        out[v.family.name, "gamma"] = folder / f"{v.family.name}_ls.pth"
        torch.save(to_layerscale(sd, v.family), out[v.family.name, "gamma"])
        for to in (
            "official",
            "transformers",
            "timm",
        ):  # from the ls layout, without the classifier some have no place for
            out[v.family.name, to] = folder / f"{v.family.name}_backbone.pth"
            torch.save(
                {
                    k: t
                    for k, t in to_layerscale(sd, v.family).items()
                    if not re.match(r"head\.(?:fc\.)?(?:weight|bias)", k)
                },
                out[v.family.name, to],
            )
        for name in ("official", "transformers"):  # the authors' and transformers' files, for reading them
            if name in v.family.layouts and v.family.name in ("convnext", "beit"):
                layout = v.family.layouts[name]
                sd = torch.load(out[v.family.name, name], weights_only=True)
                tensors = target_tensors(sd, v, v.family.layouts["ls"], layout)
                out[v.family.name, f"from:{name}"] = folder / f"{v.family.name}-{name}.pth"
                torch.save(layout.wrap(tensors), out[v.family.name, f"from:{name}"])
        if v.family.name == "convnext":  # DINOv3ConvNextModel's folder (the other names transformers reads)
            import transformers

            from timm_layerscale.families.convnext import transformers_config

            c = transformers_config(v, {})
            cfg = transformers.DINOv3ConvNextConfig(hidden_sizes=c.hidden_sizes, depths=c.depths, image_size=v.img_size)
            seed_parameters_(model := transformers.DINOv3ConvNextModel(cfg), seed=1)
            model.save_pretrained(folder / "dinov3-convnext")
            out[v.family.name, "from:dinov3"] = folder / "dinov3-convnext"
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


def _written(family: families.Family) -> list[str]:
    """The layouts a family writes beyond ``ls`` and the one ``gamma`` names (each record once)."""
    skip = (family.layouts["ls"], family.layouts[family.alias("pth")])
    return [name for name in family.targets() if all(family.layouts[name] is not s for s in skip)]


#: Every family read (``ls``) and written (``gamma``, then every other layout it writes); and reading the other
#: layouts of the families whose tiny sources the fixture writes in them.
CASES = [(f, to, d) for f in families.FAMILIES for to in ("ls", "gamma") for d in (None, "bf16")]
CASES += [(name, to, None) for name, f in families.FAMILIES.items() for to in _written(f)]
CASES += [(f, f"from:{to}", None) for f in ("convnext", "beit") for to in ("official", "transformers")]
CASES += [("convnext", "from:dinov3", None)]


@pytest.mark.parametrize(("family", "to", "dtype"), CASES)
def test_convert_refuses_every_mutation(family, to, dtype, sources, tiny_variants, tmp_path, capsys):
    for mutation in EXPECTED:
        with pytest.MonkeyPatch.context() as patch:
            _inject(patch, family, to, mutation)
            out, extra = tmp_path / f"{mutation}.pth", ("--dtype", dtype) if dtype else ()
            target = "ls" if to.startswith("from:") else to
            code, stdout, err = cli(capsys, "convert", sources[family, to], out, "--to", target, *extra, *ONE)
        _assert_refused(mutation, code, stdout, err, out, dropped=DROPPED.get(to, {}).get(family, ""))


@pytest.mark.parametrize(("family", "to"), [(f, "ls") for f in families.FAMILIES] + [("cait", "gamma")])
@pytest.mark.full
def test_export_refuses_every_mutation(family, to, sources, tiny_variants, tmp_path, capsys):
    for mutation in EXPECTED:
        with pytest.MonkeyPatch.context() as patch:
            _inject(patch, family, "ls", mutation)
            folder = tmp_path / mutation
            code, stdout, err = cli(capsys, "export", sources[family, "ls"], folder, "--to", to, *ONE)
        _assert_refused(mutation, code, stdout, err, folder, dropped=DROPPED["ls"].get(family, ""))
        assert mutation != "clean" or (folder / "model.safetensors").is_file()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_file_damaged_between_write_and_read_back_is_refused(suffix, sources, tiny_variants, tmp_path, capsys):
    """The weight check reads the written file back: damage there exits 1, and nothing is put in place."""
    from timm_layerscale.files.read import load_checkpoint

    real = converter.check_written

    def damaged(written, *args):
        gate = next(v for k, v in load_checkpoint(written).items() if k.endswith("ls2.gamma"))
        damage_inside(written, gate.clone())
        real(written, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(converter, "check_written", damaged)
        out = tmp_path / f"model{suffix}"
        code, stdout, err = cli(capsys, "convert", sources["cait", "ls"], out, *ONE)
    assert code == 1 and not out.exists() and not list(tmp_path.iterdir()), err
    assert "the written file differs from the source" in err and "NOT all equal" in stdout


def _official_dinov3(sources, tmp_path, change, name="official.pth") -> Path:
    """The tiny DINOv3's official file with ``change(state_dict)`` made to its tensors, at ``name`` (a file a
    conversion read is not rewritten: its checksums may still be read in the background)."""
    from timm_layerscale.conversion.rules import target_tensors as _target
    from timm_layerscale.families import get_variant

    v = get_variant("tinytest_dinov3_ls")
    ls = torch.load(sources["dinov3", "official"], weights_only=True)
    sd = {k: t.clone() for k, t in _target(ls, v, v.family.layouts["ls"], v.family.layouts["official"]).items()}
    change(sd)
    torch.save(sd, path := tmp_path / name)
    return path


def _live_k(sd, mask=None, value=0.5):
    for key in [k for k in sd if k.endswith("qkv.bias")]:
        sd[key][sd[key].numel() // 3 : 2 * sd[key].numel() // 3] = value
        if mask is None:
            del sd[f"{key}_mask"]
        else:
            sd[f"{key}_mask"] = torch.full_like(sd[key], 1.0) if mask == "ones" else sd[f"{key}_mask"]


#: Values of an official DINOv3 file that timm's loader drops unseen, and what a conversion must say of each.
DROPS = {
    "live k bias, no mask": (lambda sd: _live_k(sd), 2, "non-zero k third"),
    "live k bias, all-ones mask": (lambda sd: _live_k(sd, "ones"), 2, "is not [1, 0, 1]"),
    "zero k bias, all-ones mask": (lambda sd: sd.update({k: torch.ones_like(v) for k, v in sd.items() if k.endswith("_mask")}), 2, "is not [1, 0, 1]"),
    "periods off": (lambda sd: sd["rope_embed.periods"].mul_(1.1), 2, "rotary periods"),
    "live k bias, [1, 0, 1] mask": (lambda sd: _live_k(sd, "101"), 0, "k third masked by bias_mask [1, 0, 1]"),
    # the authors' model computes bias * bias_mask and cls_token + 0 * mask_token: NaN and Inf reach every output
    "NaN k third, [1, 0, 1] mask": (lambda sd: _live_k(sd, "101", math.nan), 2, "NaN * 0 is NaN"),
    "Inf mask_token": (lambda sd: sd["mask_token"].fill_(math.inf), 2, "adds 0 * mask_token"),
}  # fmt: skip


@pytest.mark.parametrize("case", DROPS)
def test_a_tensor_is_dropped_only_where_its_values_prove_it_inert(case, sources, tiny_variants, tmp_path, capsys):
    change, status, said = DROPS[case]
    out = tmp_path / "out.safetensors"
    for allow in ((), ("--allow-nonfinite",)):  # a proof holds on finite values only, allowed or not
        source = _official_dinov3(sources, tmp_path, change, f"official{len(allow)}.pth")
        code, stdout, err = cli(capsys, "convert", source, out, *ONE, *allow)
        assert code == status and out.exists() == (status == 0), err
        assert said in (stdout if status == 0 else err)
        if status:
            assert len(err.splitlines()) == 1
        out.unlink(missing_ok=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.full
def test_a_fold_bug_is_refused_at_every_gate_size(dtype, sources, tiny_variants, tmp_path, capsys):
    """A fold rule that scales every gate by 1.01 reaches both sides of the weight comparison; the fold check,
    ``gamma * W`` computed apart in float64, refuses it at released gate sizes too."""
    from timm_layerscale.conversion import fold
    from timm_layerscale.layer_scale import fold_weights

    sd = torch.load(sources["cait", "gamma"], weights_only=True)
    for gate in (0.1, 1e-5, 1e-6):
        torch.save(
            {k: torch.full_like(v, gate) if k.endswith("gamma") else v for k, v in sd.items()},
            src := tmp_path / "g.pth",
        )
        for mutated in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                if mutated:
                    patch.setattr(fold, "fold_weights", lambda w, b, g, dt=None: fold_weights(w, b, g * 1.01, dt))
                out = tmp_path / "folded.safetensors"
                code, _, err = cli(capsys, "convert", src, out, "--fold", "--dtype", dtype, *ONE)
            assert code == (1 if mutated else 0) and out.exists() != mutated, (gate, err)
            # at a released gate size the outputs move too little for their bound: the fold check alone refuses
            assert not mutated or "is not gamma * W rounded once" in err or (gate == 0.1 and "does not match" in err), (
                err
            )
            out.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("family", "wrong"),
    [
        ("dinov3", (r"(blocks\.\d+\.mlp)\.fc2\.(weight|bias)", r"\1.fc2.\2")),
        ("dinov2", (r"(blocks\.\d+\.mlp)\.fc2\.(weight|bias)", r"\1.w3.\2")),
    ],
)
def test_official_key_names_the_authors_code_does_not_load_are_refused(
    family, wrong, sources, tiny_variants, tmp_path, capsys
):
    """A SwiGLU ``fc2`` left unnamed ``w3``, a plain MLP's ``fc2`` named ``w3``: timm's filter of official files
    would read either; the authors' key set, checked before it, does not."""
    fam = families.FAMILIES[family]
    with pytest.MonkeyPatch.context() as patch:
        layout = fam.layouts["official"]
        patch.setitem(fam.layouts, "official", dataclasses.replace(layout, write=(Rule(*wrong), *layout.write)))
        out = tmp_path / "official.pth"
        code, _, err = cli(capsys, "convert", sources[family, "official"], out, "--to", "official", *ONE)
    assert code == 2 and not out.exists() and "does not fit the authors' DinoVisionTransformer" in err, err


def _as_released(sd) -> None:
    """An official DINOv3 file as released: periods rounded to bf16, a live k third under [1, 0, 1], a mask token."""
    sd["rope_embed.periods"] = sd["rope_embed.periods"].bfloat16()
    sd["mask_token"].normal_(generator=torch.Generator().manual_seed(3))
    _live_k(sd, "101")


def test_an_official_file_verifies_against_its_copy_and_its_conversions(sources, tiny_variants, tmp_path, capsys):
    """``verify`` reads both files by their own layouts' rules: what either drops or synthesises is proven inert on
    its own values, the rest equal. A released official file passes against a byte copy, against its ``ls``
    conversion, and its conversion to its own layout keeps every stored value (and says so); a file whose rotary
    periods differ fails, naming the tensor."""
    import shutil

    source = _official_dinov3(sources, tmp_path, _as_released)
    shutil.copy(source, copy := tmp_path / "copy.pth")
    for args in (("convert", source, tmp_path / "ls.safetensors"), ("convert", source, tmp_path / "again.pth")):
        code, out, err = cli(capsys, *args, "--to", Path(args[2]).stem.replace("again", "official"), *ONE)
        assert code == 0, err
    assert "rope_embed.periods (kept as stored)" in out and "qkv.bias (kept as stored) x3" in out
    again, original = torch.load(tmp_path / "again.pth", weights_only=True), torch.load(source, weights_only=True)
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in original)
    for pair in ((source, copy), (tmp_path / "ls.safetensors", source), (source, tmp_path / "again.pth")):
        code, out, err = cli(capsys, "verify", *pair, *ONE)
        assert code == 0 and "PASS" in out, (pair, err, out)

    def doubled(sd) -> None:
        _as_released(sd)
        sd["blocks.1.ls2.gamma"].mul_(2)

    off = _official_dinov3(sources, tmp_path, doubled, "b.pth")
    code, out, err = cli(capsys, "verify", source, off, *ONE)
    assert code == 1 and "blocks.1.ls2.gamma differs from its source by up to" in out, out


def test_a_source_edited_during_its_conversion_is_refused(sources, tiny_variants, tmp_path, capsys, monkeypatch):
    """Another process writes into the source after it was read: its hash would not name the bytes converted, so
    nothing is written and the one-line error says why."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file(torch.load(sources["cait", "gamma"], weights_only=True), source := tmp_path / "ls.safetensors")
    verify = converter.verify_outputs

    def edited_meanwhile(*args, **kwargs):
        edit = "import sys; f = open(sys.argv[1], 'r+b'); f.seek(-4, 2); f.write(bytes([0, 0, 128, 63]))"
        subprocess.run([sys.executable, "-c", edit, str(source)], check=True)
        return verify(*args, **kwargs)

    monkeypatch.setattr(converter, "verify_outputs", edited_meanwhile)
    code, _, err = cli(capsys, "convert", source, out := tmp_path / "out.pth", "--to", "official", *ONE)
    assert code == 2 and err.endswith("ls.safetensors changed while it was converted; nothing written\n"), err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ls.safetensors"]
