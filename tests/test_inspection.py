"""Tests for the LayerScale gate profile, table and plot (timm_layerscale.inspection)."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from helpers import damage_inside
from timm_layerscale import to_layerscale
from timm_layerscale.errors import LayerScaleError
from timm_layerscale.inspection import MissingPlotDependency, format_gate_table, gate_profile, plot_gates
from timm_layerscale.parity.inputs import seed_parameters_


@pytest.fixture(scope="module")
def official() -> dict:
    """A tiny timm CaiT (3 blocks + 2 class-attention blocks) with random gammas, official layout."""
    from helpers import TINY_CAIT

    model = timm.create_model("cait_xxs24_224", **TINY_CAIT)
    seed_parameters_(model, seed=0)
    return {"model": {"module." + k: v for k, v in model.state_dict().items()}, "epoch": 3}


def _stats(t: torch.Tensor) -> dict:
    a = t.abs()
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


def test_profile_of_an_official_checkpoint(official: dict) -> None:
    rows = gate_profile(official)
    assert [r["block"] for r in rows] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks_token_only.0",
        "blocks_token_only.1",
    ]
    assert [r["depth"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["class_attn"] for r in rows] == [False, False, False, True, True]
    assert all(r["dim"] == 32 and r["layout"] == "gamma" for r in rows)
    sd = official["model"]
    assert rows[1]["ls1"] == pytest.approx(_stats(sd["module.blocks.1.gamma_1"]))
    assert rows[4]["ls2"] == pytest.approx(_stats(sd["module.blocks_token_only.1.gamma_2"]))
    json.dumps(rows)


def test_any_layout_and_any_container_gives_the_same_numbers(official: dict, tmp_path: Path) -> None:
    reference = gate_profile(official)
    ls = to_layerscale(official["model"], "cait")
    torch.save(official, tmp_path / "official.pth")
    save_file({k: v.contiguous() for k, v in ls.items()}, tmp_path / "model.safetensors")
    for source in (ls, tmp_path / "official.pth", str(tmp_path / "model.safetensors"), tmp_path):
        rows = gate_profile(source)
        assert [{k: v for k, v in r.items() if k != "layout"} for r in rows] == [
            {k: v for k, v in r.items() if k != "layout"} for r in reference
        ]
    assert {r["layout"] for r in gate_profile(ls)} == {"ls"}


def test_other_families_and_nested_stages() -> None:
    model = timm.create_model(
        "deit3_small_patch16_224", img_size=32, embed_dim=32, depth=2, num_heads=2, num_classes=10
    )
    rows = gate_profile(model.state_dict())
    assert [r["block"] for r in rows] == ["blocks.0", "blocks.1"]
    assert not any(r["class_attn"] for r in rows)
    assert rows[0]["ls1"] == pytest.approx(_stats(model.get_parameter("blocks.0.ls1.gamma").detach()))
    nested = {
        "stages.1.blocks.0.gamma": torch.full((4,), 2.0),
        "stages.0.blocks.10.gamma": torch.full((4,), -1.0),
        "stages.0.blocks.2.gamma": torch.tensor([1.0, -3.0]),
    }
    rows = gate_profile(nested)
    assert [r["block"] for r in rows] == ["stages.0.blocks.2", "stages.0.blocks.10", "stages.1.blocks.0"]
    assert rows[0]["family"] == "convnext" and rows[0]["ls"] == {"mean": 2.0, "min": 1.0, "max": 3.0}
    assert rows[1]["ls"]["mean"] == 1.0 and "ls1" not in rows[1]
    assert format_gate_table(rows).splitlines()[0].split()[3:6] == ["ls", "mean", "ls"]


def test_model_name_checks_the_gates(official: dict) -> None:
    ref = timm.create_model("cait_xxs24_224")
    rows = gate_profile(ref.state_dict(), model="cait_xxs24_224_ls")
    assert len(rows) == 26
    assert rows[0]["ls1"] == pytest.approx({"mean": 1e-5, "min": 1e-5, "max": 1e-5})
    with pytest.raises(LayerScaleError, match="do not fit cait_xxs24_224_ls"):
        gate_profile(official, model="cait_xxs24_224_ls")


def test_model_name_checks_the_gate_width() -> None:
    # cait_s24_224 has the blocks of cait_xxs24_224, each 384 channels wide, not 192.
    xxs = timm.create_model("cait_xxs24_224", pretrained=False).state_dict()
    with pytest.raises(
        LayerScaleError, match=r"52 of another width \(first blocks\.0\.ls1: 192 channels, the model's 384\)"
    ):
        gate_profile(xxs, model="cait_s24_224_ls")


def test_errors_are_one_line(official: dict, tmp_path) -> None:
    with pytest.raises(LayerScaleError, match=r"^the state dict holds no LayerScale gates"):
        gate_profile({"head.weight": torch.zeros(2, 2)})
    with pytest.raises(LayerScaleError, match=r"^the state dict holds no weights \(an empty state dict\)"):
        gate_profile({})
    # a file is named: which of several an empty one is, not that it has no gates
    for sd, what in [({}, "no weights (an empty state dict)"), ({"head.weight": torch.zeros(2)}, "no LayerScale")]:
        torch.save(sd, tmp_path / "ckpt.pth")
        with pytest.raises(LayerScaleError, match=f"^{re.escape(str(tmp_path / 'ckpt.pth'))} holds {re.escape(what)}"):
            gate_profile(tmp_path / "ckpt.pth")
    torch.save(official, tmp_path / "damaged.pth")
    damage_inside(tmp_path / "damaged.pth", official["model"]["module.blocks.1.gamma_1"], 16)
    with pytest.raises(LayerScaleError, match=r"damaged.pth is corrupt \(Bad CRC-32 for file"):
        gate_profile(tmp_path / "damaged.pth")
    with pytest.raises(LayerScaleError, match="mixes"):
        gate_profile({"blocks.0.gamma_1": torch.ones(2), "blocks.1.ls1.gamma": torch.ones(2)})
    with pytest.raises(LayerScaleError, match="pass ema=True"):
        gate_profile({"model_ema": official["model"]})
    assert len(gate_profile({"model_ema": official["model"]}, ema=True)) == 5


def test_table_marks_class_attention_blocks(official: dict) -> None:
    text = format_gate_table(gate_profile(official), title="tiny")
    lines = text.splitlines()
    assert lines[0] == "tiny"
    header = "block kind dim ls1 mean ls1 min ls1 max ls2 mean ls2 min ls2 max"
    assert lines[1].split() == header.split()
    body = {line.split()[0]: line.split() for line in lines[3:8]}
    assert body["blocks.0"][1] == "SA" and body["blocks_token_only.1"][1] == "CA"
    assert "3 self-attention (SA) block(s); 2 class-attention (CA) block(s), depth 3-4" in text


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_card_sized_png(official: dict, tmp_path: Path) -> None:
    out = plot_gates(gate_profile(official), tmp_path / "gates.png", title="tiny CaiT")
    assert out == tmp_path / "gates.png"
    width, height = _png_size(out)
    assert (width, height) == (1200, 675)


def test_plot_format_follows_the_suffix(official: dict, tmp_path: Path, capsys) -> None:
    from timm_layerscale.cli import main

    rows = gate_profile(official)
    assert plot_gates(rows, tmp_path / "gates.svg").read_bytes().lstrip().startswith(b"<?xml")
    assert plot_gates(rows, tmp_path / "gates.PDF").read_bytes().startswith(b"%PDF")
    with pytest.raises(LayerScaleError, match=r"cannot draw a \.txt file.*name the plot \.png"):
        plot_gates(rows, tmp_path / "gates.txt")
    code = main(["inspect", str(tmp_path / "missing.pth"), "--plot", str(tmp_path / "gates.txt")])
    assert code == 2 and "cannot draw a .txt file" in capsys.readouterr().err  # before reading the source
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gates.PDF", "gates.svg"]


def test_plot_without_matplotlib_says_what_to_install(official: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPlotDependency, match=r"pip install 'timm-layerscale\[plot\]'"):
        plot_gates(gate_profile(official), tmp_path / "gates.png")
    assert not (tmp_path / "gates.png").exists()


def test_a_plot_of_a_url_is_titled_without_its_query(official: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    """A presigned URL's signature stays out of the plot, which may be shared."""
    from timm_layerscale.cli import main
    from timm_layerscale.files.read import cached_url_path

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    url = "https://storage.example/runs/ckpt.pth?X-Amz-Signature=s3cr3t"
    cached = cached_url_path(url)  # downloaded before: read from the cache
    cached.parent.mkdir(parents=True)
    torch.save(official, cached)
    assert main(["inspect", url, "--plot", str(tmp_path / "gates.svg")]) == 0
    svg = (tmp_path / "gates.svg").read_text()  # matplotlib keeps each text as a comment
    assert "ckpt.pth: LayerScale gates" in svg and "s3cr3t" not in svg


def test_inspect_reads_every_layout_and_explains_a_refusal(tmp_path, tiny_variants, capsys) -> None:
    """Gates named otherwise (transformers' ``layer_scale1.lambda1``) are read through the file's layout; a file whose
    conversion is refused (rotary periods of another base) still shows its gate table, then the reason, naming the
    file; a file with no gates at all is an error naming the file."""
    from helpers import cli
    from timm_layerscale import to_gamma
    from timm_layerscale.conversion.rules import to_layout
    from timm_layerscale.families.dinov3 import official_buffers
    from tiny_models import DINOV3

    ls = to_layerscale(
        to_gamma(seed_parameters_(timm.create_model("tinytest_dinov3")).state_dict(), "dinov3"), "dinov3"
    )
    ls.pop("head.weight"), ls.pop("head.bias")
    save_file(to_layout(ls, "dinov3", "transformers"), hf := tmp_path / "hf.safetensors")
    code, out, err = cli(capsys, "inspect", hf)
    assert code == 0 and "blocks.2" in out and "hf.safetensors: DINOv3 tinytest_dinov3_ls, transformers layout" in out
    official = {**to_layout(ls, "dinov3", "official"), **official_buffers(DINOV3)}
    official["rope_embed.periods"] = official["rope_embed.periods"] * 1.5
    torch.save(official, off := tmp_path / "off.pth")
    code, out, err = cli(capsys, "inspect", off)
    assert code == 0 and "ls2 mean" in out and "off.pth: refused: checkpoint's rope_embed.periods are not" in out
    save_file({"x.weight": torch.ones(2)}, none := tmp_path / "none.safetensors")
    code, out, err = cli(capsys, "inspect", none)
    assert code == 2 and "none.safetensors holds no LayerScale gates" in err and len(err.splitlines()) == 1
