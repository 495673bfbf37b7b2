"""The tables of models (the README's per family, ``docs/models.md``'s per model) say what the one variant table and
the registry say."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import timm

import timm_layerscale  # noqa: F401  (registers the models)
from timm_layerscale.conversion.detect import state_dict_shapes
from timm_layerscale.families import VARIANTS, Variant

README = Path(__file__).resolve().parents[1] / "README.md"
MODELS = README.parent / "docs" / "models.md"


def _table(header_start: str, document: Path = README) -> list[list[str]]:
    """The rows (cells, backticks removed) of the document's table whose header row starts with ``header_start``."""
    lines = document.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("`", "") for c in line.strip("|").split("|")])
    return rows


def _params_m(v: Variant) -> str:
    return f"{sum(math.prod(s) for s in state_dict_shapes(v).values()) / 1e6:.1f}"


def _tags(name: str) -> str:
    tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{name}.*")]
    return ", ".join(tags) if tags else "none released"


@pytest.mark.full
def test_model_table_is_the_variant_table() -> None:
    rows = _table("| model | timm reference twin |", MODELS)
    ours = [v for v in VARIANTS if v.reference != v.name]  # the models this package registers
    assert [r[0] for r in rows] == [v.name for v in ours]
    for row, v in zip(rows, ours, strict=True):
        assert row[1] == (v.reference or "—"), row
        assert row[2] == _params_m(v), row
        assert int(row[3]) == v.img_size, row
        assert float(row[4]) == v.init_value, row
        assert row[5] == _tags(v.name), row


def _init(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-") if value < 0.01 else f"{value:g}"


@pytest.mark.full
def test_family_table_sums_up_the_variant_table() -> None:
    rows = _table("| family | models | params (M) | LayerScale init |")
    ours = [v for v in VARIANTS if v.reference != v.name]
    families = list(dict.fromkeys(v.family for v in ours))
    assert [r[0] for r in rows] == [f.title for f in families]
    for row, family in zip(rows, families, strict=True):
        mine = [v for v in ours if v.family is family]
        assert row[1] == f"{mine[0].name} ... {mine[-1].name} ({len(mine)})", row
        params = [float(_params_m(v)) for v in mine]
        assert row[2] == f"{min(params):.1f}-{max(params):.1f}", row
        inits = sorted({v.init_value for v in mine if v.init_value is not None}, reverse=True)
        assert row[3] == ", ".join(map(_init, inits)), row


def test_deit3_rows_are_timms_models() -> None:
    assert sorted(v.name for v in VARIANTS if v.family.name == "deit3") == sorted(timm.list_models("deit3_*"))


def test_model_files_register_the_table() -> None:
    ours = {v.name for v in VARIANTS if v.family.name in ("cait", "vit5", "convnext", "beit", "resmlp", "xcit", "pe")}
    modules = ("cait_ls", "vit5", "convnext_ls", "beit_ls", "resmlp_ls", "xcit_ls", "pe_ls")
    assert ours == {name for module in modules for name in timm.list_models(module=module)}
