"""The package reads top to bottom: no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "timm_layerscale"

LAYERS = [
    {"_version", "errors", "progress", "layer_scale"},
    {"layers", "authors"},
    {"families"},
    {"conversion"},
    {"files"},
    {"models"},
    {"parity"},
    {"inspection", "catalog", "options"},
    {"converter"},
    {"hub"},
    {"demo"},
    {"cli", "__main__", "__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _part(dotted: str) -> str:
    """The top-level part of the package a dotted module name is in (``__init__`` for the package itself)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Line and dotted name of every module of the package that ``path`` imports."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "timm_layerscale"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "timm_layerscale":
                target = node.module or ""
            else:
                continue
            if node.module is None or target == "timm_layerscale":  # from . import x: x is a module
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def test_every_module_has_a_layer():
    parts = {_part(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(RANK), f"no layer for {sorted(parts - set(RANK))}; add it to LAYERS"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_from_a_layer_above(path):
    own = _part(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    upward = [
        f"line {line}: {target} ({_part(target)}, layer {RANK[_part(target)]} > {RANK[own]})"
        for line, target in _imports(path)
        if RANK.get(_part(target), -1) > RANK[own]
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}, layer {RANK[own]}) imports from above: {upward}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule would catch the import that used to run back up (the key rules reaching the converter)."""
    fake = tmp_path / "timm_layerscale" / "conversion"
    fake.mkdir(parents=True)
    (fake / "keys.py").write_text("def f():\n    from ..converter import convert_checkpoint\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "timm_layerscale")
    with pytest.raises(AssertionError, match=r"line 2: timm_layerscale\.converter"):
        test_no_import_from_a_layer_above(fake / "keys.py")
