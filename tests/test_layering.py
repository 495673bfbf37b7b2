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


#: Key words of particular families: shared code reads them from the family records, never names them.
FAMILY_WORDS: tuple[str, ...] = (
    "blocks_token_only",
    "proj_l",
    "stem.0",
    "patch_embed",
    "pos_embed",
    "norm_pre",
    "head.fc",
    "gamma_1",
)
FAMILY_WORDS += ("gamma_2", "gamma1", "gamma2", "gamma3", "cls_attn_blocks", "linear_tokens", "mlp_channels")
FAMILY_WORDS += ("lambda1", "lambda_1", "layer_scale1", "layer_scale_parameter", "attn.proj", "mlp.fc2", "reg_token")
FAMILY_WORDS += ("cls_token", "mask_token", "storage_tokens", "downsample_layers", "pos_embeder", "ls1", "ls2", "ls3")


def shared_modules() -> list[Path]:
    """The modules no one family owns: all but a family's own module (``families/<name>.py``, ``families/vit.py``
    that the ViT families share) and the model code (``models/``, ``layers/``, ``authors/``)."""
    from timm_layerscale.families import FAMILIES

    own = {PACKAGE / "families" / f"{name}.py" for name in [*FAMILIES, "vit"]}
    models = [PACKAGE / part for part in ("models", "layers", "authors")]
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p not in own and not any(m in p.parents for m in models)]


def code_of(path: Path) -> str:
    """A module's code as ``ast.unparse`` gives it, without docstrings and comments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            setattr(node, "body", kept or [ast.Pass()])  # noqa: B010
    return ast.unparse(tree)


def test_shared_code_names_no_family_key():
    found = [(p.relative_to(PACKAGE), w) for p in shared_modules() for w in FAMILY_WORDS if w in code_of(p)]
    assert not found, f"shared modules name a family's keys (read them from its record): {found}"


def test_the_check_sees_a_family_key_in_shared_code(tmp_path):
    module = tmp_path / "detect.py"
    module.write_text('"""Reads gamma_1."""\n# gamma_1\nKEY = "blocks.0.gamma_1"\n')
    assert [w for w in FAMILY_WORDS if w in code_of(module)] == ["gamma_1"]
