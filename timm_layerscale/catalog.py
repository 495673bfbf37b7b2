"""The table of registered models shown by ``timm-layerscale list`` and the README."""

from __future__ import annotations

from typing import Any

__all__ = ["registered_models", "model_catalog", "format_catalog"]


def registered_models() -> list[str]:
    """Names of every model this package registers with timm (every variant but timm's own), in table order."""
    import timm

    from . import models  # noqa: F401  (registers the models)
    from .families import VARIANTS

    return [v.name for v in VARIANTS if v.reference != v.name and timm.is_model(v.name)]


def model_catalog(flops: bool = False) -> list[dict[str, Any]]:
    """One row per registered model: name, reference, params, resolution, init value, pretrained tags, and
    with ``flops`` the multiplications of one forward pass of one image; built on the meta device."""
    import timm
    import torch

    from .families import get_variant

    rows = []
    for name in registered_models():
        variant = get_variant(name)
        with torch.device("meta"):
            # pretrained_cfg and flop_count are attributes that nn.Module does not declare
            model: Any = timm.create_model(name)
        cfg = model.pretrained_cfg
        row: dict[str, Any] = {
            "name": name,
            "family": variant.family.name,
            "reference": variant.reference or "-",
            "params": sum(p.numel() for p in model.parameters()),
            "resolution": int(cfg["input_size"][-1]),
            "init_value": variant.init_value,
            "pretrained": timm.list_pretrained(f"{name}.*"),
        }
        if flops:
            row["flops"] = model.flop_count(batch_size=1)
        rows.append(row)
    return rows


def format_catalog(rows: list[dict[str, Any]], flops: bool = False) -> str:
    """The catalogue as an aligned plain-text table."""
    head = ["model", "reference", "params (M)", "res", "init", "pretrained tags"]
    if flops:
        head.insert(4, "GMul")
    table = [head]
    for r in rows:
        tags = ", ".join(t.split(".", 1)[1] for t in r["pretrained"]) or "-"
        line = [
            r["name"],
            r["reference"],
            f"{r['params'] / 1e6:.1f}",
            str(r["resolution"]),
            f"{r['init_value']:g}",
            tags,
        ]
        if flops:
            line.insert(4, "-" if r.get("flops") is None else f"{r['flops'] / 1e9:.2f}")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)
