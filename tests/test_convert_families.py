"""``timm-layerscale convert`` on official ViT-5 training dicts and official DeiT-III files."""

from __future__ import annotations

import argparse
import json

import pytest
import timm
import torch

import timm_layerscale  # noqa: F401
from timm_layerscale.cli import main
from timm_layerscale.families import get_variant
from timm_layerscale.families.vit5 import official_model
from timm_layerscale.files.read import load_checkpoint
from timm_layerscale.parity.inputs import seed_parameters_
from timm_layerscale.parity.tolerance import independent_bound

BOUND = independent_bound(12, 384)  # ViT-5 small


@pytest.fixture(scope="module")
def vit5_training_dict(tmp_path_factory):
    """An official-layout ViT-5 small training dict with distinct 'model' and 'model_ema' weights."""
    ref = official_model(get_variant("vit5_small_patch16_224"))
    seed_parameters_(ref, seed=7)
    model_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    seed_parameters_(ref, seed=8)
    ema_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    path = tmp_path_factory.mktemp("vit5") / "vit5_small_patch16_224.pth"
    torch.save(
        {
            "model": model_sd,
            "model_ema": ema_sd,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]},
            "epoch": 799,
            "args": argparse.Namespace(model="vit5_small", lr=4e-3),
        },
        path,
    )
    return path, model_sd, ema_sd


def _official_logits(sd, x):
    ref = official_model(get_variant("vit5_small_patch16_224"))
    ref.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return ref.eval()(x)


def test_vit5_training_dict_converts_and_loads(vit5_training_dict, tmp_path, capsys):
    src, model_sd, _ = vit5_training_dict
    out = tmp_path / "vit5_small.safetensors"
    assert main(["convert", str(src), str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"] == "vit5_small_patch16_224" and res["family"] == "vit5"
    rep = res["report"]
    # An independent reference: the family's stated tolerance, not bit-exactness, is required.
    assert rep["passed"] and rep["attention"].startswith("manual")
    assert (rep["atol"], rep["rtol"]) == (BOUND, BOUND) and "independent" in rep["tolerance_reason"]
    assert rep["weights_equal"] and rep["weights_compared"] == len(sd_ls_keys(model_sd))
    assert res["metadata"]["parity"] in ("bit-exact", "within tolerance")
    assert res["metadata"]["parity_atol"] == f"{BOUND:g}"
    sd = load_checkpoint(out)
    assert not any(k.endswith(".freqs") for k in sd) and "blocks.0.ls1.gamma" in sd
    model = timm.create_model(
        "vit5_small_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(out))
    ).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(x)
    expected = _official_logits(model_sd, x)
    assert (got - expected).abs().max() <= 1e-5
    assert torch.equal(got.argmax(1), expected.argmax(1))


def sd_ls_keys(sd):
    return [k for k in sd if not k.endswith(".freqs")]


def test_vit5_bf16_conversion_verifies_in_fp32_within_the_independent_bound(vit5_training_dict, tmp_path, capsys):
    src, _, _ = vit5_training_dict
    out = tmp_path / "vit5_small_bf16.safetensors"
    assert main(["convert", str(src), str(out), "--dtype", "bf16", "--num-inputs", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["report"]
    assert rep["dtype"] == "bfloat16" and rep["compute_dtype"] == "float32" and rep["passed"] and rep["weights_equal"]
    assert (rep["atol"], rep["rtol"]) == (BOUND, BOUND)
    assert {v.dtype for v in load_checkpoint(out).values()} == {torch.bfloat16}


def test_vit5_exact_demands_equality(vit5_training_dict, tmp_path, capsys):
    src, _, _ = vit5_training_dict
    out = tmp_path / "vit5_small_exact.safetensors"
    code = main(["convert", str(src), str(out), "--exact", "--num-inputs", "1", "--json"])
    rep = json.loads(capsys.readouterr().out)["report"]
    assert (rep["atol"], rep["rtol"]) == (0, 0) and rep["tolerance_reason"] == "exact parity requested"
    assert rep["passed"] == rep["bit_exact"] and code == (0 if rep["bit_exact"] else 1)
    assert out.exists() == rep["bit_exact"]


def test_vit5_ema_and_gamma_round_trip(vit5_training_dict, tmp_path):
    src, _, ema_sd = vit5_training_dict
    ls = tmp_path / "ema.safetensors"
    assert main(["convert", str(src), str(ls), "--ema", "--no-verify"]) == 0
    back = tmp_path / "official.pth"
    assert main(["convert", str(ls), str(back), "--to", "gamma", "--no-verify"]) == 0
    wrapped = load_checkpoint(back)
    assert list(wrapped) == ["model"]  # the official code loads checkpoint['model']
    restored = wrapped["model"]
    assert restored.keys() == ema_sd.keys()
    for k, v in ema_sd.items():
        if k.endswith(".freqs"):
            assert torch.allclose(restored[k], v, rtol=1e-6, atol=0), k
        else:
            assert torch.equal(restored[k], v), k
    ref = official_model(get_variant("vit5_small_patch16_224"))
    ref.load_state_dict(restored, strict=True)


@pytest.mark.parametrize("family", ["convnext", "beit"])
def test_a_convolutional_or_beit_training_checkpoint_converts_its_model_or_its_ema(
    family, tiny_variants, tmp_path, capsys
):
    """A DDP training checkpoint of timm's layout (``{'model': {'module.' + key}, 'model_ema': ..., 'epoch'}``) gives
    its model's weights, and with ``--ema`` its EMA's, each verified bit-exact."""
    from helpers import cli, randomize
    from timm_layerscale import to_layerscale

    v = next(t for t in tiny_variants if t.family.name == family)
    sd = randomize(timm.create_model(str(v.reference))).state_dict()
    ema = {k: t * 1.5 if "gamma" in k else t for k, t in sd.items()}
    checkpoint = {"model": {f"module.{k}": t for k, t in sd.items()}, "model_ema": ema, "epoch": 3}
    torch.save(checkpoint, src := tmp_path / "checkpoint.pth")
    for extra, want in (((), sd), (("--ema",), ema)):
        out = tmp_path / f"out{len(extra)}.safetensors"
        code, stdout, err = cli(capsys, "convert", src, out, *extra, "--num-inputs", "1")
        assert code == 0 and "PASS (bit-exact)" in stdout, err
        got = load_checkpoint(out)
        assert got.keys() == (ls := to_layerscale(want, family)).keys() and all(torch.equal(got[k], ls[k]) for k in ls)
