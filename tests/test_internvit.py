"""InternViT-300M: the authors' files (bare, or the vision part of an InternVL chat checkpoint) and transformers'
``InternVLVisionModel`` folders into timm's own ``vit_intern300m_patch14_448`` and back, verified."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from helpers import cli
from test_dinov3 import seeded
from timm_layerscale.conversion.rules import target_tensors


def authors_file(name: str) -> dict[str, torch.Tensor]:
    """A seeded timm model's weights in the authors' ``InternVisionModel`` layout."""
    from timm_layerscale.families import get_variant

    v = get_variant(name)
    return target_tensors(seeded(name).state_dict(), v, v.family.layouts["ls"], v.family.layouts["official"])


def test_an_authors_folder_and_a_chat_checkpoint_convert_both_ways(tmp_path, tiny_variants, capsys) -> None:
    """The authors' folder as they publish it (``config.json`` beside ``model.safetensors``), and a chat checkpoint's
    vision tower beside its projector and language model, which are named and left; back, the authors' keys."""
    official = authors_file("tinytest_internvit")
    (folder := tmp_path / "InternViT").mkdir()
    save_file(official, folder / "model.safetensors")
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b"})
    )
    code, out, err = cli(capsys, "convert", folder, tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0 and "(official layout)" in out and "bit-exact" in out, err
    chat = {f"vision_model.{k}": v for k, v in official.items()}
    chat |= {"mlp1.0.weight": torch.ones(4), "language_model.model.embed_tokens.weight": torch.ones(8, 4)}
    save_file(chat, tmp_path / "chat.safetensors")
    code, out, err = cli(
        capsys, "convert", tmp_path / "chat.safetensors", tmp_path / "chat-ls.safetensors", "--num-inputs", "1"
    )
    assert code == 0 and "bit-exact" in out and "language_model.model.embed_tokens.weight" in out, err
    code, out, err = cli(
        capsys,
        "convert",
        tmp_path / "ls.safetensors",
        tmp_path / "back.safetensors",
        "--to",
        "official",
        "--num-inputs",
        "1",
    )
    assert code == 0 and "bit-exact" in out, err
    back = load_file(tmp_path / "back.safetensors")
    assert back.keys() == official.keys() and all(torch.equal(back[k], official[k]) for k in back)


def test_a_transformers_folder_converts_both_ways(tmp_path, tiny_variants, capsys) -> None:
    """``InternVLVisionModel`` as ``save_pretrained`` writes it into timm's layout, verified against transformers' own
    model, and exported back as a folder ``AutoModel`` loads with no key missing, unexpected or resized."""
    import transformers

    from timm_layerscale.conversion.detect import state_dict_shapes
    from timm_layerscale.families.internvit import transformers_config
    from tiny_models import INTERNVIT

    theirs = transformers.InternVLVisionModel(transformers_config(INTERNVIT, state_dict_shapes(INTERNVIT, 0)))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    theirs.save_pretrained(tmp_path / "hf")
    code, out, err = cli(capsys, "convert", tmp_path / "hf", tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0 and "(transformers layout)" in out and "another library" in out, err
    code, out, err = cli(capsys, "export", tmp_path / "ls.safetensors", tmp_path / "tf", "--to", "transformers", "-q")
    assert code == 0 and err == "", err
    again, info = transformers.AutoModel.from_pretrained(tmp_path / "tf", output_loading_info=True)
    assert type(again) is type(theirs) and not any(
        info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    )
    assert again.config.attention_bias and not again.config.use_qk_norm and again.config.use_mean_pooling
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.eval()(x).last_hidden_state, theirs.eval()(x).last_hidden_state)
