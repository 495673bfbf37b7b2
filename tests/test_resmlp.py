"""ResMLP with LayerScale modules: timm's ``MlpMixer`` of ``ResBlock`` s with ``ls1``/``ls2`` modules, outputs and
gradients ``torch.equal`` to timm's ``resmlp_*``, the tags remapped as they load, features; the authors' files
(``attn``, ``mlp``, ``gamma_1``, ``Affine`` vectors ``(dim,)``) converted both ways; ``ls1`` refused to fold."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.utils import reparameterize_model

import timm_layerscale  # noqa: F401
from helpers import assert_computes_as_its_twin, assert_one_line_error, cli, randomize, tiny_twins
from timm_layerscale.conversion import rules
from timm_layerscale.conversion.rules import target_tensors
from timm_layerscale.families import get_variant, variants_of

VARIANTS = variants_of("resmlp")


def pair() -> tuple[Any, Any]:
    return tiny_twins("resmlp")


def test_outputs_intermediates_and_gradients_equal_timms() -> None:
    """Batch 1 and 3, bf16 autocast, ``forward_intermediates``, compiled, a training step's gradients: equal bit for
    bit."""
    assert_computes_as_its_twin(*pair(), "resmlp", 32)


@pytest.mark.full
def test_fx_torchscript_and_export_as_timms_tests_check_them() -> None:
    from helpers import assert_traces_and_scripts

    _, ours = pair()
    features = timm.create_model("tinytest_resmlp_ls", features_only=True, feature_cls="fx", out_indices=(1,))
    assert_traces_and_scripts(ours, torch.randn(2, 3, 32, 32), features.eval(), dynamic_size=False)


def test_files_load_remapped_and_ls1_is_refused_to_fold(tmp_path, tiny_variants, capsys) -> None:
    """timm's and the authors' files load through ``pretrained_cfg_overlay``; ``ls1`` scales a token-mixing linear
    with a bias per token, so ``reparameterize_model``, a folded model and ``convert --fold`` are refused in one
    line that says why."""
    ref, ours = pair()
    v = get_variant("tinytest_resmlp_ls")
    ls = rules.to_layerscale(ref.state_dict(), "resmlp")
    save_file({k: t.contiguous() for k, t in ref.state_dict().items()}, str(timm_file := tmp_path / "t.safetensors"))
    torch.save(target_tensors(ls, v, v.family.layouts["ls"], v.family.layouts["official"]), fb := tmp_path / "fb.pth")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for path in (timm_file, fb):
        args: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}}
        loaded: Any = timm.create_model("tinytest_resmlp_ls", pretrained=True, **args).eval()
        assert torch.equal(loaded(x), ref(x))
    why = "ls1 scales a token-mixing linear whose bias is per token"
    with pytest.raises(ValueError, match=why):
        reparameterize_model(ours)
    with pytest.raises(ValueError, match=why):
        timm.create_model("resmlp_12_224_ls", folded_layerscale=True)
    assert_one_line_error(*cli(capsys, "convert", fb, tmp_path / "f.safetensors", "--fold", "--no-verify"), why)


@pytest.mark.parametrize("name", ["resmlp_12_224", pytest.param("resmlp_big_24_224", marks=pytest.mark.full)])
def test_the_authors_file_converts_both_ways_at_real_size(name, tmp_path, capsys) -> None:
    """At real size (``resmlp_12_224`` in the fast tier, the big one in the full one): the authors' plain state dict (their key names, ``Affine`` vectors) to the
    ``ls`` layout and back, each bit-exact against timm's model reading the source through its own filter."""
    v = get_variant(f"{name}_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(randomize(timm.create_model(name)).state_dict(), "resmlp")
    authors = target_tensors(ls, v, v.family.layouts["ls"], official)
    assert authors["blocks.0.norm1.alpha"].shape == (v.embed_dim,) and "blocks.0.attn.weight" in authors
    torch.save(authors, src := tmp_path / str(v.official_file))
    one = ("--num-inputs", "1")
    code, out, err = cli(capsys, "convert", src, ls_file := tmp_path / "ls.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "official layout" in out, err
    code, out, err = cli(capsys, "convert", ls_file, back := tmp_path / "back.pth", "--to", "official", *one)
    assert code == 0 and "PASS (bit-exact)" in out, err
    written = torch.load(back, weights_only=True)
    assert written.keys() == authors.keys() and all(torch.equal(written[k], authors[k]) for k in authors)
