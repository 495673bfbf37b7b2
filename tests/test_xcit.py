"""XCiT with LayerScale modules: timm's ``Xcit`` with ``ls1``/``ls3``/``ls2`` modules in its XCA blocks and
``ls1``/``ls2`` in its class-attention blocks, outputs and gradients ``torch.equal`` to timm's ``xcit_*``, the tags
remapped as they load; the authors' files (``pos_embeder``, a fused class-attention ``qkv``) converted both ways;
folding refused for the class-attention ``ls1``, which scales the normed patch tokens too."""

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
from timm_layerscale.inspection import format_gate_table, gate_profile

VARIANTS = variants_of("xcit")


def pair() -> tuple[Any, Any]:
    return tiny_twins("xcit")


def test_outputs_intermediates_and_gradients_equal_timms() -> None:
    """Batch 1 and 3, fused attention and not, bf16 autocast, ``forward_intermediates``, compiled, a training step's
    gradients: equal bit for bit."""
    assert_computes_as_its_twin(*pair(), "xcit", 32)


@pytest.mark.full
def test_fx_torchscript_and_export_as_timms_tests_check_them() -> None:
    from helpers import assert_traces_and_scripts

    _, ours = pair()
    features = timm.create_model("tinytest_xcit_ls", features_only=True, feature_cls="fx", out_indices=(1,))
    assert_traces_and_scripts(ours, torch.randn(2, 3, 32, 32), features.eval(), dynamic_size=False)


def test_files_load_remapped_gates_read_and_fold_is_refused(tmp_path, tiny_variants, capsys) -> None:
    """timm's and the authors' files load through ``pretrained_cfg_overlay``; the gate table has one column per gate
    name, the class-attention blocks last; folding is refused in one line saying why (the class-attention ``ls1``
    scales the normed patch tokens too)."""
    ref, ours = pair()
    v = get_variant("tinytest_xcit_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(ref.state_dict(), "xcit")
    save_file({k: t.contiguous() for k, t in ref.state_dict().items()}, str(timm_file := tmp_path / "t.safetensors"))
    torch.save(official.wrap(target_tensors(ls, v, v.family.layouts["ls"], official)), fb := tmp_path / "fb.pth")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for path in (timm_file, fb):
        args: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}}
        loaded: Any = timm.create_model("tinytest_xcit_ls", pretrained=True, **args).eval()
        assert torch.equal(loaded(x), ref(x))
    rows = gate_profile(fb)
    assert [r["block"] for r in rows] == ["blocks.0", "blocks.1", "cls_attn_blocks.0", "cls_attn_blocks.1"]
    assert [r["class_attn"] for r in rows] == [False, False, True, True] and rows[2]["ls3"] is None
    assert format_gate_table(rows).split()[3:21:6] == ["ls1", "ls3", "ls2"]
    why = "class-attention ls1 scales the normed patch tokens"
    with pytest.raises(ValueError, match=why):
        reparameterize_model(ours)
    with pytest.raises(ValueError, match=why):
        timm.create_model("tinytest_xcit_ls", folded_layerscale=True)
    assert_one_line_error(*cli(capsys, "convert", fb, tmp_path / "f.safetensors", "--fold", "--no-verify"), why)


@pytest.mark.parametrize("name", ["xcit_nano_12_p16_224", pytest.param("xcit_large_24_p8_224", marks=pytest.mark.full)])
def test_the_authors_file_converts_both_ways_at_real_size(name, tmp_path, capsys) -> None:
    """At real size (nano in the fast tier, large with patch 8 in the full one): the authors' ``{'model': ...}`` (``pos_embeder``, a fused
    class-attention ``qkv``) to the ``ls`` layout and back, each bit-exact against timm's model reading the source
    through its own filter, the written file equal to the source tensor for tensor."""
    v = get_variant(f"{name}_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(randomize(timm.create_model(name)).state_dict(), "xcit")
    authors = target_tensors(ls, v, v.family.layouts["ls"], official)
    qkv = authors["cls_attn_blocks.0.attn.qkv.weight"]
    assert qkv.shape == (3 * v.embed_dim, v.embed_dim) and "pos_embeder.token_projection.bias" in authors
    torch.save(official.wrap(authors), src := tmp_path / f"{name}.pth")
    one = ("--num-inputs", "1")
    code, out, err = cli(capsys, "convert", src, ls_file := tmp_path / "ls.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "official layout" in out, err
    code, out, err = cli(capsys, "convert", ls_file, back := tmp_path / "back.pth", "--to", "official", *one)
    assert code == 0 and "PASS (bit-exact)" in out, err
    written = torch.load(back, weights_only=True)["model"]
    assert written.keys() == authors.keys() and all(torch.equal(written[k], authors[k]) for k in authors)
