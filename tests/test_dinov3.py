"""DINOv3 with LayerScale modules: timm's ``Eva`` with ``ls1``/``ls2``, outputs ``torch.equal`` to timm's
``vit_*_dinov3[_qkvb]``, its Hub files remapped as they load, folding, features and timm's model checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.utils import reparameterize_model

import timm_layerscale  # noqa: F401
from timm_layerscale.conversion import rules as remap
from timm_layerscale.errors import CheckpointError, RemapError
from timm_layerscale.families import variants_of
from timm_layerscale.families.dinov3 import split_qkv_bias
from timm_layerscale.layer_scale import LayerScale
from timm_layerscale.models.dinov3_ls import checkpoint_filter_fn

NAME = "vit_small_patch16_dinov3_qkvb_ls"
VARIANTS = variants_of("dinov3")


def seeded(name: str, seed: int = 0, **kwargs: Any) -> Any:
    """A registered model with every parameter random (gates and biases ~ N(0, 0.1), so each term counts)."""
    model = timm.create_model(name, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            scale = p[0].numel() ** -0.5 if p.ndim >= 2 else 0.1
            p.copy_((key.endswith("weight") and p.ndim == 1) + scale * torch.randn(p.shape, generator=g))
    return model.eval()


def official_layout(model: Any) -> dict[str, torch.Tensor]:
    """A timm DINOv3's weights as the official code saves them: ``storage_tokens``, a ``(1, D)`` ``mask_token``, the
    rotary ``periods``, ``ls1.gamma``, SwiGLU ``w1``/``w2``/``w3``, a fused ``qkv.bias`` whose k third (random here)
    its ``bias_mask`` zeroes; no classifier, as the authors' model has none."""
    sd, out = model.state_dict(), {}  # type: dict[str, torch.Tensor], dict[str, torch.Tensor]
    words = [("reg_token", "storage_tokens"), ("gamma_1", "ls1.gamma"), ("gamma_2", "ls2.gamma")]
    words += [("mlp.fc1_g", "mlp.w1"), ("mlp.fc1_x", "mlp.w2"), ("mlp.fc2", "mlp.w3")] if "fc1_g" in str(model) else []
    for key, value in sd.items():
        if key.endswith("attn.q_bias"):
            at = key.removesuffix("q_bias")
            k = torch.randn(value.shape, generator=torch.Generator().manual_seed(len(out)))
            out[at + "qkv.bias"] = torch.cat([value, k, sd[at + "v_bias"]])
            out[at + "qkv.bias_mask"] = torch.cat([torch.ones_like(value), torch.zeros_like(k), torch.ones_like(value)])
        elif not key.endswith("attn.v_bias") and not key.startswith("head."):
            for old, new in words:
                key = key.replace(old, new)
            out[key] = value
    return {**out, "mask_token": torch.zeros(1, model.embed_dim), "rope_embed.periods": model.rope.periods.clone()}


def training_checkpoint(sd: dict[str, torch.Tensor], chunks: int = 0) -> dict[str, Any]:
    """An official-layout state dict as DINO's training code saves its teacher (``teacher_checkpoint.pth``): under
    ``backbone.`` beside the objective's heads, blocks nested in ``chunks`` chunks (``blocks.K.N.``) where asked."""
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))

    def chunked(key: str) -> str:
        if not chunks or not key.startswith("blocks."):
            return key
        n = int(key.split(".")[1])
        return f"blocks.{n * chunks // depth}.{key.removeprefix('blocks.')}"

    heads = {"dino_head.mlp.0.weight": torch.ones(8, 4), "ibot_head.last_layer.weight": torch.ones(16, 8)}
    return {"teacher": {**{f"backbone.{chunked(k)}": v for k, v in sd.items()}, **heads}}


def pair(name: str = "tinytest_dinov3", **kwargs: Any) -> tuple[Any, Any]:
    """timm's DINOv3 with random weights, and this package's model loaded from its state dict through the filter."""
    import tiny_models  # noqa: F401  (registers the tiny models)

    ref = seeded(name, **kwargs)
    ours: Any = timm.create_model(f"{name}_ls", **kwargs).eval()
    ours.load_state_dict(checkpoint_filter_fn(ref.state_dict(), ours))
    return ref, ours


@pytest.fixture(scope="module")
def small() -> tuple[Any, Any]:
    return pair("vit_small_patch16_dinov3")


@pytest.mark.parametrize(
    ("name", "batch", "size"), [("tiny", 1, (32, 32)), ("tiny", 3, (40, 24)), ("small", 2, (256, 224))]
)
@pytest.mark.full
def test_outputs_equal_timms(name, batch, size, small, fused_attn) -> None:
    """Fused and math attention, fp32 and bf16 autocast, square and not: the class, register and patch tokens
    and the pooled output of timm's DINOv3, bit for bit."""
    ref, ours = small if name == "small" else pair()
    x = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(batch))
    for fused in (True, False):
        fused_attn(fused)
        with torch.no_grad():
            assert torch.equal(ours.forward_features(x), ref.forward_features(x))
            assert torch.equal(ours(x), ref(x))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(ours(x), ref(x))


@pytest.mark.full
def test_settings_of_the_cait_promise_hold() -> None:
    """Threads, token pooling, another image size at build, dropout off in eval, compile: still equal."""
    ref, ours = pair(global_pool="token", img_size=48)
    x = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            assert torch.equal(ours(x), ref(x))
    finally:
        torch.set_num_threads(threads)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(ours, backend="aot_eager")(x), torch.compile(ref, backend="aot_eager")(x))


@pytest.mark.full
def test_fx_torchscript_and_export_as_timms_tests_check_them() -> None:
    """timm's test_models checks: FX feature extraction, TorchScript, ``torch.export`` with a dynamic batch (timm's
    Eva fixes its rotary grid when exported, for its own model too, so height and width stay static)."""
    from helpers import assert_traces_and_scripts

    _, ours = pair()
    features = timm.create_model("tinytest_dinov3_ls", features_only=True, feature_cls="fx", out_indices=(1,))
    assert_traces_and_scripts(ours, torch.randn(2, 3, 32, 48), features.eval(), dynamic_size=False)


@pytest.mark.slow  # inductor compiles its C++ kernels
def test_inductors_code_computes_alike() -> None:
    ref, ours = pair()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.inference_mode():
        assert torch.equal(torch.compile(ours)(x), torch.compile(ref)(x))


def test_training_step_and_gradients_equal_timms() -> None:
    ref, ours = pair()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ref.train()(x).square().mean().backward()
    ours.train()(x).square().mean().backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    for key, p in remap.to_layerscale(dict(ref.named_parameters()), "dinov3").items():
        assert torch.equal(grads[key], p.grad), key


def test_fold_features_and_intermediates() -> None:
    ref, ours = pair()
    x = torch.randn(2, 3, 32, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        final, inter = ours.forward_intermediates(x, indices=2)
        want_final, want_inter = ref.forward_intermediates(x, indices=2)
        assert torch.equal(final, want_final) and all(map(torch.equal, inter, want_inter))
        folded = reparameterize_model(ours)
        assert folded.folded_layerscale and not any(isinstance(m, LayerScale) for m in folded.modules())
        torch.testing.assert_close(folded(x), ref(x), rtol=1e-5, atol=1e-5)
    features: Any = timm.create_model("tinytest_dinov3_ls", features_only=True, out_indices=(0, 2))
    assert [tuple(f.shape) for f in features(x)] == [(2, 32, 4, 3)] * 2
    assert features.feature_info.channels() == [32, 32]


@pytest.mark.compat
def test_timms_file_loads_remapped_and_folded(tmp_path) -> None:
    """A file in timm's layout (as its Hub copies are) through ``pretrained_cfg_overlay``, into the module layout
    and into a ``folded_layerscale`` model."""
    ref = seeded("vit_small_patch16_dinov3_qkvb")
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    overlay: dict[str, Any] = {"pretrained_cfg_overlay": {"file": str(path)}}
    ours: Any = timm.create_model(NAME, pretrained=True, **overlay).eval()
    folded = timm.create_model(NAME, pretrained=True, folded_layerscale=True, **overlay).eval()
    assert ours.pretrained_cfg["hf_hub_id"] == "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"
    assert ours.pretrained_cfg["license"] == "dinov3-license"
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        torch.testing.assert_close(folded(x), ref(x), rtol=1e-5, atol=1e-5)


def test_an_official_file_converts_and_loads_as_timms_loader_reads_it(tmp_path, tiny_variants, capsys) -> None:
    """The official layout (fused q/k/v bias, storage tokens, SwiGLU ``w1``-``w3``, pretraining-only tensors) into
    the module layout, verified against timm's own loader of the same file; and read by ``pretrained_cfg_overlay``."""
    from helpers import cli

    ref, _ = pair()
    path = tmp_path / "dinov3_official.pth"
    torch.save(official_layout(ref), path)
    file = {"file": str(path)}
    via_timm: Any = timm.create_model("tinytest_dinov3", pretrained=True, num_classes=0, pretrained_cfg_overlay=file)
    ours: Any = timm.create_model("tinytest_dinov3_ls", pretrained=True, num_classes=0, pretrained_cfg_overlay=file)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = ref.forward_features(x)
        assert torch.equal(via_timm.eval().forward_features(x), features)
        assert torch.equal(ours.eval().forward_features(x), features)
    code, out, err = cli(capsys, "convert", path, tmp_path / "ls.safetensors", "--num-inputs", "1")
    assert code == 0, err
    assert "(official layout)" in out and "reference              tinytest_dinov3\n" in out and "bit-exact" in out
    assert "at 32x32, 1 more (seed 1) at 32x24, forward_features tokens" in out  # a second, non-square size
    # and back to the official layout: the file timm's loader reads as the source, the k bias zero, buffers computed
    from safetensors.torch import load_file

    code, out, err = cli(capsys, "convert", tmp_path / "ls.safetensors", tmp_path / "official.pth", "--to", "official",
                         "--num-inputs", "1")  # fmt: skip
    assert code == 0 and "bit-exact" in out, err
    official = official_layout(ref)
    written = torch.load(tmp_path / "official.pth", weights_only=True)
    assert written.keys() == official.keys() and torch.equal(written["rope_embed.periods"], ref.rope.periods)
    for key, value in written.items():
        expected = official[key].clone()
        expected[32:64] = 0 if key.endswith("qkv.bias") else expected[32:64]  # the k third, masked in any case
        assert torch.equal(value, 0 * expected if key == "mask_token" else expected), key
    back, teacher = tmp_path / "timm.safetensors", tmp_path / "teacher_checkpoint.pth"
    torch.save(training_checkpoint({**official_layout(ref), "projectors.0.weight": torch.ones(4, 4)}), teacher)
    code, out, err = cli(capsys, "convert", teacher, back, "--to", "gamma", "--num-inputs", "1")
    assert code == 0 and "bit-exact" in out and "dino_head.mlp.N.weight" in out and "projectors.N.weight" in out, err

    assert load_file(back).keys() == {k for k in ref.state_dict() if not k.startswith("head.")}
    # a wrong value operation (q and v exchanged in the split) reaches only the converted side: refused
    from timm_layerscale import families

    fam = families.FAMILIES["dinov3"]

    def swapped(at, bias, *_):
        return {f"{at}.q_bias": bias.chunk(3)[2], f"{at}.v_bias": bias.chunk(3)[0]}

    official_layout_ = fam.layouts["official"]
    swap = tuple(dataclasses.replace(r, op=swapped) if r.op is split_qkv_bias else r for r in official_layout_.read)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(fam.layouts, "official", dataclasses.replace(official_layout_, read=swap))
        code, out, err = cli(capsys, "convert", path, tmp_path / "wrong.safetensors", "--num-inputs", "1")
    assert code == 1 and "FAIL" in out and not (tmp_path / "wrong.safetensors").exists(), err


@pytest.mark.full
def test_a_model_without_q_and_v_biases_takes_them_only_where_they_are_zero(tmp_path, capsys) -> None:
    """The distilled releases' zero q and v biases (a random k third, which the official mask zeroes) load into the
    plain model and convert to it, verified against timm's plain model; non-zero ones are refused, naming ``_qkvb``."""
    from helpers import assert_one_line_error, cli

    ref = seeded("vit_small_patch16_dinov3_qkvb")
    with torch.no_grad():
        for block in ref.blocks:
            block.attn.q_bias.zero_(), block.attn.v_bias.zero_()
    zero, biased = tmp_path / "zero.pth", tmp_path / "biased.pth"
    torch.save(official_layout(ref), zero)
    torch.save(official_layout(seeded("vit_small_patch16_dinov3_qkvb")), biased)
    plain = "vit_small_patch16_dinov3_ls"
    code, out, err = cli(capsys, "convert", zero, tmp_path / "z.safetensors", "--model", plain, "--num-inputs", "1")
    assert code == 0 and "bit-exact" in out and "blocks.N.attn.q_bias (zero) x12" in out, err
    ours: Any = timm.create_model(plain, pretrained=True, pretrained_cfg_overlay={"file": str(zero)}).eval()
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    code, out, err = cli(capsys, "convert", tmp_path / "z.safetensors", tmp_path / "o.pth", "--to", "official")
    assert code == 0 and "bit-exact" in out, err  # zero q/k/v biases and their mask written back
    assert not torch.load(tmp_path / "o.pth", weights_only=True)["blocks.11.attn.qkv.bias"].any()
    code, out, err = cli(capsys, "convert", biased, tmp_path / "b.safetensors", "--model", plain)
    assert_one_line_error(code, out, err, "read it as vit_small_patch16_dinov3_qkvb_ls")
    with pytest.raises(RemapError, match="read it as vit_small_patch16_dinov3_qkvb_ls"):
        timm.create_model(plain, pretrained=True, pretrained_cfg_overlay={"file": str(biased)})


@pytest.mark.usefixtures("few_inputs")
def test_an_export_loads_in_timm_and_transformers_with_the_dinov3_licence(tmp_path, tiny_variants) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModel

    from timm_layerscale.hub.card import hub_license
    from timm_layerscale.hub.export import export_folder

    ref, _ = pair()
    path = tmp_path / "dinov3_official.pth"
    torch.save(official_layout(ref), path)
    for to in ("ls", "gamma"):
        folder = export_folder(path, tmp_path / to, to=to, plot=False, repo_id="org/dinov3").folder
        model: Any = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        assert type(model).__name__ == ("DinoV3LS" if to == "ls" else "Eva")
        backbone = AutoModel.from_pretrained(folder).eval()
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model.forward_features(x), ref.forward_features(x))
            pooled = ref.forward_head(ref.forward_features(x), pre_logits=True)
            assert torch.equal(backbone(pixel_values=x).pooler_output, pooled)
    card = ModelCard.load(tmp_path / "ls" / "README.md")
    assert "dropped / split" in card.text and "mask_token" in card.text
    # transformers' own folder: its config class's config.json, AutoModel builds DINOv3ViTModel without the package
    torch.save(ref.state_dict(), classifier := tmp_path / "classifier.pth")  # timm's layout, with a classifier
    with pytest.raises(CheckpointError, match="no classifier to hold"):
        export_folder(classifier, tmp_path / "tf", to="transformers", plot=False)
    with pytest.raises(CheckpointError, match="for the official file, convert"):
        export_folder(path, tmp_path / "tf", to="official", plot=False)
    folder = export_folder(path, tmp_path / "tf", to="transformers", plot=False, repo_id="org/dinov3").folder
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DINOv3ViTModel"]
    theirs = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(pixel_values=x).last_hidden_state, ref.forward_features(x))
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and card.data.license == ref.pretrained_cfg["license"]
    assert hub_license("dinov3-license") == {"license": "other", "license_name": "dinov3-license"}
    assert hub_license("apache-2.0") == {"license": "apache-2.0"}
    assert 'AutoModel.from_pretrained("org/dinov3")' in card.text and "timm.create_model" not in card.text


@pytest.mark.usefixtures("few_inputs")
def test_a_transformers_folder_converts_both_ways_within_the_library_bound(tmp_path, tiny_variants, official, capsys):
    """transformers' ``DINOv3ViTModel`` as ``save_pretrained`` writes it (split q/k/v, no k bias, SwiGLU gate/up/down,
    a ``(1, 1, C)`` mask token) into the module layout, verified against transformers' own model; and back."""
    import transformers
    from safetensors.torch import load_file

    from helpers import cli
    from timm_layerscale.conversion.detect import state_dict_shapes
    from timm_layerscale.families.dinov3 import transformers_config
    from tiny_models import DINOV3

    theirs = transformers.DINOv3ViTModel(transformers_config(DINOV3, state_dict_shapes(DINOV3, 0)))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    theirs.save_pretrained(tmp_path / "hf")
    code, out, err = cli(capsys, "convert", tmp_path / "hf", tmp_path / "ls.safetensors")
    assert code == 0 and "(transformers layout)" in out and "transformers/tinytest_dinov3" in out, err
    assert "embeddings.mask_token" in out and "fuse_qkv" in out and "another library" in out
    ours: Any = timm.create_model("tinytest_dinov3_ls", num_classes=0, pretrained=True,
                             pretrained_cfg_overlay={"file": str(tmp_path / "ls.safetensors")}).eval()  # fmt: skip
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    direct: Any = timm.create_model(
        "tinytest_dinov3_ls",
        num_classes=0,
        pretrained=True,
        pretrained_cfg_overlay={"file": str(tmp_path / "hf" / "model.safetensors")},
    )
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), theirs.eval()(pixel_values=x).last_hidden_state)
        assert torch.equal(direct.eval().forward_features(x), ours.forward_features(x))  # the file read as it loads
    code, out, err = cli(capsys, "convert", tmp_path / "ls.safetensors", tmp_path / "back.safetensors", "--to",
                         "transformers")  # fmt: skip
    assert code == 0, err
    written = load_file(tmp_path / "back.safetensors")
    assert written.keys() == load_file(tmp_path / "hf" / "model.safetensors").keys()
    assert not written["embeddings.mask_token"].any() and written["embeddings.mask_token"].shape == (1, 1, 32)
    code, out, err = cli(capsys, "convert", official, tmp_path / "cait.pth", "--to", "transformers")
    assert code == 2 and "CaiT has no layout 'transformers'" in err and not (tmp_path / "cait.pth").exists()


def test_a_verification_beyond_the_machines_memory_streams(monkeypatch) -> None:
    """On 24 GiB the 7B's in-memory check (two fp32 copies, ~54 GB) runs one block at a time; asked to run in memory,
    or on a machine where not even a block fits, one line says so before anything is built."""
    from timm_layerscale.errors import CheckpointError
    from timm_layerscale.families import get_variant
    from timm_layerscale.parity import verify

    big = get_variant("vit_7b_patch16_dinov3_ls")
    monkeypatch.setattr(verify, "_available", lambda: 24 * 2**30)
    assert verify._streams(big, None) and not verify._streams(get_variant("vit_small_patch16_dinov3_ls"), None)
    with pytest.raises(CheckpointError, match=r"in memory \(two fp32 copies.* needs about [\d.]+ GiB .* no.verify"):
        verify._streams(big, False)
    monkeypatch.setattr(verify, "_available", lambda: 2**30)
    with pytest.raises(CheckpointError, match=r"one block at a time needs about [\d.]+ GiB and 1.0 GiB"):
        verify._streams(big, True)
