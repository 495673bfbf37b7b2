"""DINOv2: the official files (``mask_token``, ``register_tokens``, a class slot in ``pos_embed``) and transformers'
``Dinov2Model`` / ``Dinov2WithRegistersModel`` files into timm's own ``vit_*_dinov2`` and back, verified."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from safetensors.torch import load_file

from helpers import cli
from test_dinov3 import seeded, training_checkpoint


def official_layout(model: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    """A timm DINOv2's weights as the official code saves them: ``mask_token`` ``(1, C)``, ``register_tokens`` and,
    with registers, a (random) class slot in ``pos_embed`` that the class token does not yet hold."""
    sd, g = dict(model.state_dict()), torch.Generator().manual_seed(seed)
    out = {"mask_token": torch.randn(1, model.embed_dim, generator=g)}
    if "reg_token" in sd:
        slot = torch.randn(1, 1, model.embed_dim, generator=g)
        out |= {"cls_token": sd.pop("cls_token") - slot, "register_tokens": sd.pop("reg_token")}
        out["pos_embed"] = torch.cat([slot, sd.pop("pos_embed")], dim=1)
    return {**out, **sd}


def test_an_official_file_converts_and_loads_as_timms_loader_reads_it(tmp_path, tiny_variants, capsys) -> None:
    """Registers: the class slot merged into the class token, as timm's ``_reg4`` loader does (the function kept,
    and the report says so); back to the official layout with a zero class slot and a zero mask token."""
    ref = seeded("tinytest_dinov2")
    path = tmp_path / "dinov2_official.pth"
    torch.save(official_layout(ref), path)
    code, out, err = cli(capsys, "convert", path, tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0 and "(official layout)" in out and "bit-exact" in out, err
    assert "cls_token (merge_class_slot)" in out and "mask_token" in out and "pos_embed (drop_class_slot)" in out
    teacher = tmp_path / "teacher_checkpoint.pth"  # the training code's: backbone.blocks.K.N beside the heads
    torch.save(training_checkpoint(official_layout(ref), chunks=2), teacher)
    code, out, err = cli(capsys, "convert", teacher, tmp_path / "ls.safetensors", "--num-inputs", "1", "--overwrite")
    assert code == 0 and "bit-exact" in out and "ibot_head.last_layer.weight" in out, err
    code, out, err = cli(capsys, "convert", tmp_path / "ls.safetensors", tmp_path / "official.pth", "--to", "gamma")
    assert code == 0 and "bit-exact" in out, err
    back = torch.load(tmp_path / "official.pth", weights_only=True)  # bare, as the authors' loader reads it
    assert not back["mask_token"].any() and not back["pos_embed"][:, 0].any() and "register_tokens" in back
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for file in (path, tmp_path / "official.pth"):
        model: Any = timm.create_model("tinytest_dinov2", pretrained=True, pretrained_cfg_overlay={"file": str(file)})
        with torch.no_grad():
            torch.testing.assert_close(model.eval().forward_features(x), ref.forward_features(x))


def test_a_transformers_folder_converts_both_ways(tmp_path, tiny_variants, capsys) -> None:
    """``Dinov2WithRegistersModel`` as ``save_pretrained`` writes it (4.x names on disk) into timm's layout, verified
    against transformers' own model, and back to the names it wrote."""
    import transformers

    from timm_layerscale.conversion.detect import state_dict_shapes
    from timm_layerscale.families.dinov2 import transformers_config
    from tiny_models import DINOV2

    theirs = transformers.Dinov2WithRegistersModel(transformers_config(DINOV2, state_dict_shapes(DINOV2, 0)))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    theirs.save_pretrained(tmp_path / "hf")
    code, out, err = cli(capsys, "convert", tmp_path / "hf", tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0 and "(transformers layout)" in out and "another library" in out, err
    code, out, err = cli(capsys, "convert", tmp_path / "ls.safetensors", tmp_path / "back.safetensors", "--to",
                         "transformers", "--num-inputs", "1")  # fmt: skip
    assert code == 0, err
    assert load_file(tmp_path / "back.safetensors").keys() == load_file(tmp_path / "hf" / "model.safetensors").keys()
    # an export: a folder transformers loads natively, with the registers model's config
    code, out, err = cli(capsys, "export", tmp_path / "ls.safetensors", tmp_path / "tf", "--to", "transformers",
                         "--num-inputs", "1", "-q")  # fmt: skip
    assert code == 0 and err == "", err  # no third-party progress output either
    card = (tmp_path / "tf" / "README.md").read_text()
    assert "`Dinov2WithRegistersModel` returns `last_hidden_state` and `pooler_output`" in card
    again = transformers.AutoModel.from_pretrained(tmp_path / "tf").eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(again) is type(theirs) and torch.equal(
            again(x).last_hidden_state, theirs.eval()(x).last_hidden_state
        )


def test_the_real_size_small_official_file_converts_bit_exactly(tmp_path, capsys) -> None:
    ref = seeded("vit_small_patch14_dinov2")
    path = tmp_path / "dinov2_vits14_pretrain.pth"
    torch.save(official_layout(ref), path)
    code, out, err = cli(capsys, "convert", path, tmp_path / "s.safetensors", "--num-inputs", "1")
    assert (
        code == 0
        and "vit_small_patch14_dinov2" in out
        and "at 518x518, 1 more (seed 1) at 518x378" in out
        and "bit-exact" in out
    ), err


@pytest.mark.parametrize("name", ["vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2"])
def test_timms_own_state_dict_is_read_as_timms_layout(name) -> None:
    """timm's ``vit_*_dinov2`` state dict as it is (the authors' keys but for ``mask_token``) is read as timm's layout,
    not as an authors' file missing a key (the routes test converts it to every layout in fresh processes)."""
    from helpers import detected

    with torch.device("meta"):
        state_dict = timm.create_model(name).state_dict()
    found = detected(state_dict)
    assert (found.variant.name, found.layout.name) == (name, "ls")


def test_a_sharded_transformers_folder_converts_as_its_single_file_twin(tmp_path) -> None:
    """``save_pretrained`` with ``max_shard_size``: its index and shards, read shard by shard in a fresh process,
    give the same verified file as the one-file folder of the same model."""
    import subprocess
    import sys

    import transformers

    from timm_layerscale.conversion.detect import state_dict_shapes
    from timm_layerscale.families import get_variant
    from timm_layerscale.families.dinov2 import transformers_config

    v = get_variant("vit_small_patch14_dinov2")
    theirs = transformers.Dinov2Model(transformers_config(v, state_dict_shapes(v, 0)))
    for name, shard in (("one", "1GB"), ("sharded", "20MB")):
        theirs.save_pretrained(tmp_path / name, max_shard_size=shard)
        argv = ["-m", "timm_layerscale", "convert", tmp_path / name, tmp_path / f"{name}.safetensors"]
        p = subprocess.run([sys.executable, *map(str, [*argv, "--num-inputs", "1"])], capture_output=True, text=True)
        assert p.returncode == 0 and "bit-exact" in p.stdout, p.stderr
    assert (tmp_path / "one" / "model.safetensors").exists()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    one, sharded = (load_file(tmp_path / f"{name}.safetensors") for name in ("one", "sharded"))
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
