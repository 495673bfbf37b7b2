"""BEiT and BEiT v2 with LayerScale modules: timm's ``Beit`` with ``ls1``/``ls2``, outputs ``torch.equal`` to timm's
``beit_*``/``beitv2_*`` with their per-block relative position bias at any built size, the tags remapped as they
load, folding, features; the authors' files (with ``relative_position_index``) converted both ways; a file that fits
a BEiT and a BEiT v2 model alike is not guessed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.utils import reparameterize_model

import timm_layerscale  # noqa: F401
from helpers import cli, randomize
from timm_layerscale.conversion import rules
from timm_layerscale.conversion.rules import target_tensors
from timm_layerscale.families import get_variant, variants_of
from timm_layerscale.layer_scale import LayerScale
from timm_layerscale.models.beit_ls import checkpoint_filter_fn

VARIANTS = variants_of("beit")
SMALL: dict[str, Any] = {"depth": 2, "embed_dim": 64, "num_heads": 4}


def pair(name: str = "beitv2_base_patch16_224", **kwargs: Any) -> tuple[Any, Any]:
    """timm's BEiT of two blocks with random weights and gates, and this package's model loaded through the filter."""
    ref = randomize(timm.create_model(name, **SMALL, **kwargs)).eval()
    ours: Any = timm.create_model(f"{name}_ls", **SMALL, **kwargs).eval()
    ours.load_state_dict(checkpoint_filter_fn(ref.state_dict(), ours))
    return ref, ours


@pytest.mark.parametrize("img_size", [224, 160])
def test_outputs_and_gradients_equal_timms(img_size) -> None:
    """Batch 1 to 3, fused attention and not, bf16 autocast, one thread, at the released and another built size (each
    block's bias table resized by timm's filter), compiled: equal bit for bit; a training step's gradients too."""
    ref, ours = pair(img_size=img_size)
    threads = torch.get_num_threads()
    for batch in (1, 3):
        x = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            for fused in (True, False):
                for m in (m for model in (ref, ours) for m in model.modules() if hasattr(m, "fused_attn")):
                    m.fused_attn = fused
                assert torch.equal(ours.forward_features(x), ref.forward_features(x)) and torch.equal(ours(x), ref(x))
            with torch.autocast("cpu", torch.bfloat16):
                assert torch.equal(ours(x), ref(x))
            try:
                torch.set_num_threads(1)
                assert torch.equal(ours(x), ref(x))
            finally:
                torch.set_num_threads(threads)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(ours, backend="aot_eager")(x), torch.compile(ref, backend="aot_eager")(x))
    ref.train()(x).square().mean().backward()
    ours.train()(x).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    for key, p in rules.to_layerscale(dict(ref.named_parameters()), "beit").items():
        assert torch.equal(grads[key], p.grad), key


def test_intermediates_features_fold_and_pretrained_files(tmp_path) -> None:
    """``forward_intermediates`` and ``features_only`` as timm's; ``reparameterize_model`` folds; timm's and the
    authors' files load through ``pretrained_cfg_overlay`` into the module layout and a folded model."""
    ref, ours = pair()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    v = get_variant("beitv2_base_patch16_224_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(ref.state_dict(), "beit")
    save_file({k: t.contiguous() for k, t in ref.state_dict().items()}, str(timm_file := tmp_path / "t.safetensors"))
    authors = official.wrap(target_tensors(ls, dataclasses.replace(v, depth=2), v.family.layouts["ls"], official))
    torch.save(authors, fb := tmp_path / "fb.pth")
    with torch.no_grad():
        final, inter = ours.forward_intermediates(x, indices=1)
        want_final, want_inter = ref.forward_intermediates(x, indices=1)
        assert torch.equal(final, want_final) and all(map(torch.equal, inter, want_inter))
        for path in (timm_file, fb):
            args: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}, **SMALL}
            loaded: Any = timm.create_model("beitv2_base_patch16_224_ls", pretrained=True, **args).eval()
            assert torch.equal(loaded(x), ref(x))
            features = timm.create_model(
                "beitv2_base_patch16_224_ls", pretrained=True, features_only=True, out_indices=(1,), **args
            )
            assert torch.equal(features(x)[-1], ref.forward_intermediates(x, indices=1, intermediates_only=True)[-1])
        folded = reparameterize_model(ours)
        assert folded.folded_layerscale and not any(isinstance(m, LayerScale) for m in folded.modules())
        torch.testing.assert_close(folded(x), ref(x), rtol=1e-5, atol=1e-5)


def test_the_authors_file_converts_both_ways_and_a_twin_is_not_guessed(tmp_path, capsys) -> None:
    """``beit_base_patch16_224`` at its real size: its authors' file fits BEiT v2's base alike, so detection asks for
    ``--model`` in one line, or reads the architecture a timm folder's config names; named, it converts to ``ls`` and back, each bit-exact, the computed index dropped with its
    proof and written again; an index of another grid is refused."""
    v = get_variant("beit_base_patch16_224_ls")
    official = v.family.layouts["official"]
    ls = rules.to_layerscale(randomize(timm.create_model("beit_base_patch16_224")).state_dict(), "beit")
    authors = target_tensors(ls, v, v.family.layouts["ls"], official)
    torch.save(official.wrap(authors), src := tmp_path / "beit.pth")
    code, _, err = cli(capsys, "convert", src, tmp_path / "x.safetensors", "--no-verify")
    assert code == 2 and "--model beitv2_base_patch16_224_ls" in err and len(err.splitlines()) == 1, err
    hub = tmp_path / "hub"  # a timm folder's config.json names the architecture, as a Hub repository's does
    hub.mkdir()
    save_file({k: t.contiguous() for k, t in ls.items()}, hub / "model.safetensors")
    (hub / "config.json").write_text('{"architecture": "beitv2_base_patch16_224"}')
    code, out, err = cli(capsys, "convert", hub, tmp_path / "v2.safetensors", "--no-verify", "--json")
    assert code == 0 and '"model": "beitv2_base_patch16_224_ls"' in out, err
    one = ("--num-inputs", "1", "--model", v.name)
    code, out, err = cli(capsys, "convert", src, ls_file := tmp_path / "ls.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "relative_position_index (index computed) x12" in out, err
    code, out, err = cli(capsys, "convert", ls_file, back := tmp_path / "back.pth", "--to", "official", *one)
    assert code == 0 and "PASS (bit-exact)" in out, err
    again = torch.load(back, weights_only=True)["model"]
    assert authors.keys() == again.keys() and all(torch.equal(authors[k], again[k]) for k in authors)
    authors["blocks.3.attn.relative_position_index"] = authors["blocks.3.attn.relative_position_index"].flip(0)
    torch.save(official.wrap(authors), src)
    code, _, err = cli(capsys, "convert", src, tmp_path / "y.safetensors", *one)
    assert code == 2 and "blocks.3.attn.relative_position_index is not the index" in err, err


@pytest.mark.full
def test_transformers_folders_and_5x_names_convert_both_ways(tmp_path, tiny_variants, capsys) -> None:
    """``BeitForImageClassification`` and ``BeitModel`` as ``save_pretrained`` writes them (4.x's names, q/k/v apart
    with no k bias, ``lambda_1``), and a state dict in 5.x's names (``layers.N.attention.q_proj``), into timm's layout,
    verified against transformers' own model; the backbone back to the names transformers wrote, exported to a folder
    it loads with the same pooled output; a shared pretraining bias table refused in one line; a folder with
    transformers' default epsilon (1e-12) converts, the bound covering the epsilons' measured effect."""
    import transformers
    from safetensors.torch import load_file

    from timm_layerscale.families import state_dict_shapes
    from timm_layerscale.families.beit import transformers_config
    from tiny_models import BEIT

    one, cfg = ("--num-inputs", "1"), transformers_config(BEIT, state_dict_shapes(BEIT, 0))
    theirs = randomize(transformers.BeitModel(cfg)).eval()
    randomize(transformers.BeitForImageClassification(cfg)).save_pretrained(tmp_path / "cls")
    theirs.save_pretrained(tmp_path / "hf")
    save_file(theirs.state_dict(), tmp_path / "5x.safetensors")
    for src in (tmp_path / "cls", tmp_path / "hf", tmp_path / "5x.safetensors"):
        code, out, err = cli(capsys, "convert", src, ls := tmp_path / f"{src.stem}-ls.safetensors", *one)
        assert code == 0 and "(transformers layout)" in out and "another library" in out and "PASS" in out, err
        assert "convolutional" not in out  # transformers' attention is told as attention
    code, out, err = cli(capsys, "convert", ls, back := tmp_path / "back.safetensors", "--to", "transformers", *one)
    assert code == 0 and load_file(back).keys() == load_file(tmp_path / "hf" / "model.safetensors").keys(), err
    shared = {**load_file(back), "encoder.relative_position_bias.relative_position_bias_table": torch.zeros(52, 2)}
    save_file(shared, tmp_path / "shared.safetensors")
    code, _, err = cli(capsys, "convert", tmp_path / "shared.safetensors", tmp_path / "s.safetensors", "--no-verify")
    assert code == 2 and "shared by every block" in err and len(err.splitlines()) == 1, err
    code, out, err = cli(capsys, "export", ls, tmp_path / "tf", "--to", "transformers", *one)
    assert code == 0 and "PASS" in out, err
    again = transformers.AutoModel.from_pretrained(tmp_path / "tf").eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(again) is transformers.BeitModel and torch.equal(again(x).pooler_output, theirs(x).pooler_output)
    cfg.layer_norm_eps = 1e-12  # transformers' default in every LayerNorm, as the public folders have it
    randomize(transformers.BeitModel(cfg)).save_pretrained(tmp_path / "eps")
    code, out, err = cli(capsys, "convert", tmp_path / "eps", tmp_path / "eps.safetensors", *one)
    assert code == 0 and "PASS" in out and "the folder's layer_norm_eps 1e-12, the model's 1e-06" in out, err


@pytest.mark.slow  # about a minute: a real-size model through transformers' loading twice
def test_real_size_transformers_folder_converts_bit_exactly_both_ways(tmp_path, capsys) -> None:
    """``beit_base_patch16_224``'s ``BeitModel`` folder into timm's layout and back, each against transformers' own
    model: bit-exact on seeded weights."""
    import transformers

    from timm_layerscale.families import state_dict_shapes
    from timm_layerscale.families.beit import transformers_config

    v = get_variant("beit_base_patch16_224_ls")
    randomize(transformers.BeitModel(transformers_config(v, state_dict_shapes(v, 0)))).save_pretrained(tmp_path / "hf")
    one = ("--num-inputs", "1", "--model", v.name)
    code, out, err = cli(capsys, "convert", tmp_path / "hf", ls := tmp_path / "ls.safetensors", *one)
    assert code == 0 and "PASS (bit-exact)" in out and "transformers/beit_base_patch16_224" in out, err
    code, out, err = cli(capsys, "convert", ls, tmp_path / "back.safetensors", "--to", "transformers", *one)
    assert code == 0 and "PASS (bit-exact)" in out, err
