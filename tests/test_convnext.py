"""ConvNeXt with LayerScale modules: timm's ``ConvNeXt`` with ``ls`` gates, outputs ``torch.equal`` to timm's
``convnext_*`` in both block forms, its pretrained tags remapped as they load, folding into a Linear or a 1x1
convolution, features; the authors' files converted to every layout and back; ConvNeXt-V2 refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.utils import reparameterize_model

import timm_layerscale  # noqa: F401
from helpers import cli, randomize
from timm_layerscale.conversion import rules
from timm_layerscale.conversion.rules import target_tensors
from timm_layerscale.errors import ArchitectureError
from timm_layerscale.families import get_family, get_variant, variants_of
from timm_layerscale.layer_scale import LayerScale
from timm_layerscale.models.convnext_ls import checkpoint_filter_fn

VARIANTS = variants_of("convnext")
TINY: dict[str, Any] = {"depths": (1, 1, 2, 1), "dims": (8, 16, 24, 32)}


def pair(conv_mlp: bool, **kwargs: Any) -> tuple[Any, Any]:
    """timm's tiny ConvNeXt (``conv_mlp``: 1x1 convolutions) with random weights and gates, and this package's model
    loaded from its state dict through the filter."""
    name = "convnext_atto" if conv_mlp else "convnext_tiny"
    ref = randomize(timm.create_model(name, **TINY, **kwargs)).eval()
    ours: Any = timm.create_model(f"{name}_ls", **TINY, **kwargs).eval()
    ours.load_state_dict(checkpoint_filter_fn(ref.state_dict(), ours))
    return ref, ours


@pytest.mark.parametrize("conv_mlp", [False, True])
def test_outputs_and_gradients_equal_timms(conv_mlp) -> None:
    """Batch 1 to 3, square and not, fp32, bf16 autocast and one thread: features and logits bit for bit, and the
    memory format of every block's output; a training step's gradients too."""
    ref, ours = pair(conv_mlp)
    formats: list[list[Any]] = []
    for model in (ref, ours):
        formats.append(out := list[Any]())
        for stage in model.stages:
            stage.blocks[-1].register_forward_hook(lambda m, a, y, out=out: out.append(y.stride()))
    threads = torch.get_num_threads()
    for batch, size in ((1, (64, 64)), (2, (96, 64)), (3, (40, 72))):
        x = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            assert torch.equal(ours.forward_features(x), ref.forward_features(x)) and torch.equal(ours(x), ref(x))
            with torch.autocast("cpu", torch.bfloat16):
                assert torch.equal(ours(x), ref(x))
            try:
                torch.set_num_threads(1)
                assert torch.equal(ours(x), ref(x))
            finally:
                torch.set_num_threads(threads)
    assert formats[0] == formats[1]
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ref.train()(x).square().mean().backward()
    ours.train()(x).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    for key, p in rules.to_layerscale(dict(ref.named_parameters()), "convnext").items():
        assert torch.equal(grads[key], p.grad), key


@pytest.mark.parametrize("conv_mlp", [False, True])
@pytest.mark.full
def test_compile_intermediates_features_and_fold(conv_mlp, tmp_path) -> None:
    ref, ours = pair(conv_mlp)
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(ours, backend="aot_eager")(x), torch.compile(ref, backend="aot_eager")(x))
        final, inter = ours.forward_intermediates(x, indices=2)
        want_final, want_inter = ref.forward_intermediates(x, indices=2)
        assert torch.equal(final, want_final) and all(map(torch.equal, inter, want_inter))
        name = "convnext_atto" if conv_mlp else "convnext_tiny"
        save_file({k: t.contiguous() for k, t in ref.state_dict().items()}, str(path := tmp_path / "m.safetensors"))
        args: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}, "features_only": True, **TINY}
        features = [timm.create_model(n, pretrained=True, **args).eval() for n in (name, f"{name}_ls")]
        assert all(map(torch.equal, features[1](x), features[0](x))) and len(features[1](x)) == 4
        folded = reparameterize_model(ours)
        assert folded.folded_layerscale and not any(isinstance(m, LayerScale) for m in folded.modules())
        torch.testing.assert_close(folded(x), ref(x), rtol=1e-5, atol=1e-5)


def test_timms_file_loads_remapped_and_folded(tmp_path) -> None:
    """A file in timm's layout (as its Hub copies are) and an authors' file, through ``pretrained_cfg_overlay``,
    into the module layout and into a ``folded_layerscale`` model."""
    ref = randomize(timm.create_model("convnext_tiny", **TINY)).eval()
    v = get_variant("convnext_tiny_ls")
    official = v.family.layouts["official"]
    save_file({k: t.contiguous() for k, t in ref.state_dict().items()}, str(timm_file := tmp_path / "timm.safetensors"))
    ls = rules.to_layerscale(ref.state_dict(), "convnext")
    torch.save(official.wrap(target_tensors(ls, v, v.family.layouts["ls"], official)), fb := tmp_path / "fb.pth")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for path in (timm_file, fb):
        overlay: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}, **TINY}
        ours: Any = timm.create_model("convnext_tiny_ls", pretrained=True, **overlay).eval()
        folded = timm.create_model("convnext_tiny_ls", pretrained=True, folded_layerscale=True, **overlay).eval()
        with torch.no_grad():
            assert torch.equal(ours(x), ref(x))
            torch.testing.assert_close(folded(x), ref(x), rtol=1e-5, atol=1e-5)


def test_the_authors_file_converts_to_every_layout_and_back(tmp_path, capsys) -> None:
    """``convnext_tiny`` at its real size: the authors' ``{'model': ...}`` file to ``ls``, ``timm`` and back to theirs,
    each verified bit-exact against the source read by its own loader; the round trip gives the same tensors. A
    DINOv3 ConvNeXt file (bare, headless, its final norm also as ``norms.3``) converts, ``norms.3`` proven to be
    ``norm`` and written back; one that differs is refused."""
    v = get_variant("convnext_tiny_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(randomize(timm.create_model("convnext_tiny")).state_dict(), "convnext")
    torch.save(official.wrap(target_tensors(ls, v, v.family.layouts["ls"], official)), src := tmp_path / "fb.pth")
    one = ("--num-inputs", "1")
    code, out, err = cli(capsys, "convert", src, ls_file := tmp_path / "ls.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "(official layout" in out, err
    code, out, err = cli(capsys, "convert", ls_file, timm_file := tmp_path / "timm.pth", "--to", "timm", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "reference              convnext_tiny_ls" in out, err
    code, out, err = cli(capsys, "convert", timm_file, back := tmp_path / "back.pth", "--to", "official", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "attention              none" in out, err
    source, again = torch.load(src, weights_only=True)["model"], torch.load(back, weights_only=True)["model"]
    assert source.keys() == again.keys() and all(torch.equal(source[k], again[k]) for k in source)
    bare = {k: t for k, t in source.items() if not k.startswith("head.")}  # a headless bare file, as DINOv3's
    bare |= {f"norms.3.{p}": bare[f"norm.{p}"].clone() for p in ("weight", "bias")}  # its final norm twice
    torch.save(bare, src)
    code, out, err = cli(capsys, "convert", src, tmp_path / "bare.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "(official layout" in out, err
    assert "norms.N.weight (the final norm itself)" in out
    code, out, err = cli(capsys, "convert", tmp_path / "bare.safetensors", back, "--to", "official", "--overwrite")
    again = torch.load(back, weights_only=True)["model"]
    assert code == 0 and again.keys() == bare.keys() and torch.equal(again["norms.3.bias"], bare["norm.bias"]), err
    bare["norms.3.bias"] += 1
    torch.save(bare, src)
    code, _, err = cli(capsys, "convert", src, tmp_path / "x.safetensors", "--no-verify")
    assert code == 2 and "norms.3.bias differs from norm.bias" in err and len(err.splitlines()) == 1, err


def test_a_conv_mlp_model_is_not_written_in_the_authors_layout(tmp_path, capsys) -> None:
    ref = randomize(timm.create_model("convnext_atto"))
    torch.save(ref.state_dict(), src := tmp_path / "atto.pth")
    code, _, err = cli(capsys, "convert", src, out := tmp_path / "out.pth", "--to", "official", "--no-verify")
    assert code == 2 and not out.exists() and "no conv_mlp model" in err and len(err.splitlines()) == 1, err


def test_a_convnext_v2_file_is_not_read_as_convnext() -> None:
    """ConvNeXt-V2's ``grn.gamma`` is a GRN weight, not a gate: neither the authors' V2 keys nor timm's V2 state dict
    is read as ConvNeXt."""
    from timm_layerscale.conversion.detect import detect

    with torch.device("meta"):
        v2 = timm.create_model("convnextv2_atto").state_dict()
    authors = {k.replace("stages.0.blocks.0.mlp.grn.weight", "stages.0.0.grn.gamma"): t for k, t in v2.items()}
    for sd in (v2, authors):
        with pytest.raises(ArchitectureError, match="does not fit"):
            detect(sd)
    convnext = get_family("convnext")
    assert not convnext.gate_of("stages.0.0.grn.gamma") and not convnext.gate_of("stages.0.blocks.0.mlp.grn.gamma")


def _folders(cfg: Any, folder: Path) -> list[Path]:
    """Seeded ``ConvNextForImageClassification``, ``DINOv3ConvNextModel`` and ``ConvNextModel`` folders (in this
    order) of the widths and depths of ``cfg`` (a ``ConvNextConfig``), as ``save_pretrained`` writes them."""
    import transformers

    dinov3 = transformers.DINOv3ConvNextConfig(
        hidden_sizes=cfg.hidden_sizes, depths=cfg.depths, image_size=cfg.image_size
    )
    classes: Any = (
        transformers.ConvNextForImageClassification,
        transformers.DINOv3ConvNextModel,
        transformers.ConvNextModel,
    )
    for cls in classes:
        randomize(cls(dinov3 if "DINO" in cls.__name__ else cfg)).save_pretrained(folder / cls.__name__)
    return [folder / cls.__name__ for cls in classes]


def test_transformers_folders_convert_both_ways(tmp_path, tiny_variants, capsys) -> None:
    """``ConvNextForImageClassification`` as ``save_pretrained`` writes it (``convnext.`` keys and a classifier),
    ``DINOv3ConvNextModel`` (``model.stages``) and ``ConvNextModel`` into timm's layout, verified against transformers'
    own model; the backbone back to the names transformers wrote and exported to a folder it loads with the same pooled
    output; a classifier is refused for the backbone in one line; a folder with transformers' default final-norm
    epsilon (1e-12) converts, the bound covering the epsilons' measured effect, which the report names."""
    import transformers

    from timm_layerscale.families.convnext import transformers_config
    from tiny_models import CONVNEXT

    one = ("--num-inputs", "1")
    for hf in _folders(transformers_config(CONVNEXT, {}), tmp_path):
        code, out, err = cli(capsys, "convert", hf, ls := tmp_path / f"{hf.name}.safetensors", *one)
        assert code == 0 and "(transformers layout)" in out and "another library" in out and "PASS" in out, err
    code, _, err = cli(capsys, "convert", tmp_path / "ConvNextForImageClassification.safetensors",
                       tmp_path / "no.safetensors", "--to", "transformers", "--no-verify")  # fmt: skip
    assert code == 2 and "no classifier" in err and len(err.splitlines()) == 1, err
    code, out, err = cli(capsys, "convert", ls, back := tmp_path / "back.safetensors", "--to", "transformers", *one)
    assert code == 0 and load_file(back).keys() == load_file(hf / "model.safetensors").keys(), err
    code, out, err = cli(capsys, "export", ls, tmp_path / "tf", "--to", "transformers", *one)
    assert code == 0 and "PASS" in out, err
    cfg = transformers_config(CONVNEXT, {})
    cfg.layer_norm_eps = 1e-12  # transformers' default, as the public folders have it; the authors' is 1e-6
    randomize(transformers.ConvNextModel(cfg)).save_pretrained(tmp_path / "eps")
    code, out, err = cli(capsys, "convert", tmp_path / "eps", tmp_path / "eps.safetensors", *one)
    assert code == 0 and "PASS" in out and "the folder's layer_norm_eps 1e-12, the model's 1e-06" in out, err
    theirs, again = (transformers.AutoModel.from_pretrained(p).eval() for p in (hf, tmp_path / "tf"))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(again) is transformers.ConvNextModel
        assert torch.equal(again(x).pooler_output, theirs(x).pooler_output)


@pytest.mark.slow  # about a minute: a real-size model through transformers' loading three times
def test_real_size_transformers_folders_convert_bit_exactly_both_ways(tmp_path, capsys) -> None:
    """``convnext_tiny``'s ``ConvNextForImageClassification``, ``DINOv3ConvNextModel`` and ``ConvNextModel`` folders into
    timm's layout and the backbone back, each against transformers' own model: bit-exact on seeded weights."""

    from timm_layerscale.families.convnext import transformers_config

    one = ("--num-inputs", "1")
    for hf in _folders(transformers_config(get_variant("convnext_tiny_ls"), {}), tmp_path):
        code, out, err = cli(capsys, "convert", hf, ls := tmp_path / f"{hf.name}.safetensors", *one)
        assert code == 0 and "PASS (bit-exact)" in out and "transformers/convnext_tiny" in out, err
    code, out, err = cli(capsys, "convert", ls, tmp_path / "back.safetensors", "--to", "transformers", *one)
    assert code == 0 and "PASS (bit-exact)" in out, err
