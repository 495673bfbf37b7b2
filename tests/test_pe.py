"""Perception Encoder: the authors' files (``ls_1.gamma`` modules) and timm's ``vit_pe_*`` (raw ``gamma_1``, also a
PerceptionLM checkpoint's vision tower) into this package's ``*_ls`` and back, verified against timm's model."""

from __future__ import annotations

from typing import Any, cast

import timm
import torch
from safetensors.torch import load_file, save_file

from helpers import cli
from test_dinov3 import seeded
from timm_layerscale.conversion.rules import target_tensors


def test_an_authors_file_converts_both_ways_and_reads_as_timms_loader_reads_it(tmp_path, tiny_variants, capsys) -> None:
    from tiny_models import PE

    ref, family = seeded("tinytest_pe"), PE.family
    official = target_tensors(ref.state_dict(), PE, family.layouts["timm"], family.layouts["official"])
    assert official["class_embedding"].shape == (32,) and official["positional_embedding"].shape == (17, 32)
    torch.save(official, path := tmp_path / "PE-Lang-T.pt")
    code, out, err = cli(capsys, "convert", path, tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0 and "(official layout)" in out and "bit-exact" in out, err
    code, out, err = cli(
        capsys, "convert", tmp_path / "ls.safetensors", tmp_path / "back.pth", "--to", "official", "--num-inputs", "1"
    )
    assert code == 0 and "bit-exact" in out, err
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back.keys() == official.keys() and all(torch.equal(back[k], official[k]) for k in back)
    # timm's own filter (its _convert_pe) reads the written file into timm's model as it reads the authors'
    model: Any = timm.create_model(
        "tinytest_pe", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "back.pth")}
    )
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval().forward_features(x), ref.forward_features(x))


def test_a_perception_lm_checkpoint_reads_its_vision_tower(tmp_path, tiny_variants, capsys) -> None:
    """transformers' PerceptionLM holds timm's model under ``model.vision_tower.timm_model.``: read, its projector and
    language model named and left."""
    tower = {f"model.vision_tower.timm_model.{k}": v for k, v in seeded("tinytest_pe").state_dict().items()}
    parts = {"model.multi_modal_projector.linear_1.weight": torch.ones(4, 4), "lm_head.weight": torch.ones(8, 4)}
    save_file({**tower, **parts, "model.language_model.norm.weight": torch.ones(4)}, tmp_path / "plm.safetensors")
    code, out, err = cli(
        capsys, "convert", tmp_path / "plm.safetensors", tmp_path / "ls.safetensors", "--num-inputs", "1"
    )
    assert code == 0 and "(timm layout)" in out and "bit-exact" in out and "lm_head.weight" in out, err
    assert len(load_file(tmp_path / "ls.safetensors")) == len(tower)


def test_a_perception_encoder_without_layerscale_is_refused_naming_timms_model(tmp_path, capsys) -> None:
    import math

    from timm_layerscale.families import get_variant

    v = get_variant("vit_pe_lang_large_patch14_448_ls")
    shapes = {k: s for k, s in target_shapes(v).items() if "ls_" not in k}
    shapes |= {k.replace(".22.", ".23."): s for k, s in shapes.items() if ".resblocks.22." in k}
    torch.save({k: torch.zeros(math.prod(s)).reshape(s) for k, s in shapes.items()}, path := tmp_path / "spatial.pt")
    code, _, err = cli(capsys, "convert", path, tmp_path / "out.safetensors")
    assert code == 2 and "without LayerScale" in err and "'vit_pe_spatial_large_patch14_448'" in err, err


def target_shapes(v) -> dict[str, tuple[int, ...]]:
    from timm_layerscale.families import state_dict_shapes

    ls = {k: torch.empty(s, device="meta") for k, s in state_dict_shapes(v).items()}
    out = target_tensors(ls, v, v.family.layouts["ls"], v.family.layouts["official"])
    return {k: tuple(t.shape) for k, t in out.items()}


def test_outputs_gradients_and_timms_model_checks_as_timms(tiny_variants) -> None:
    """The ``_ls`` model on timm's weights through its filter: outputs and gradients ``torch.equal`` to timm's; FX
    features, TorchScript and ``torch.export`` as timm's test_models check them."""
    from helpers import assert_traces_and_scripts
    from timm_layerscale import to_layerscale
    from timm_layerscale.models.pe_ls import checkpoint_filter_fn

    ref, ours = seeded("tinytest_pe"), cast(Any, timm.create_model("tinytest_pe_ls"))
    ours.load_state_dict(checkpoint_filter_fn(ref.state_dict(), ours))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ref.train()(x).square().mean().backward()
    ours.train()(x).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    assert all(
        torch.equal(cast(Any, grads[k]), p.grad) for k, p in to_layerscale(dict(ref.named_parameters()), "pe").items()
    )
    with torch.no_grad():
        assert torch.equal(ours.eval()(x), ref.eval()(x))
    features = timm.create_model("tinytest_pe_ls", features_only=True, feature_cls="fx", out_indices=(1,))
    assert_traces_and_scripts(ours, x, features.eval(), dynamic_size=False)
