"""The API reference documents every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

DIRECTIVE = re.compile(r"^\.\. (?:automodule|py:module):: (\S+)", re.MULTILINE)


def _documented(pages: list[Path]) -> set[str]:
    return {name for page in pages for name in DIRECTIVE.findall(page.read_text())}


def _modules(package: Path) -> set[str]:
    """Dotted names of the package's modules, without package ``__init__`` files, ``__main__`` and ``_version``."""
    return {
        ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for path in package.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py", "_version.py")
    }


def test_every_module_has_a_page():
    missing = _modules(ROOT / "timm_layerscale") - _documented(sorted((ROOT / "docs" / "api").glob("*.rst")))
    assert not missing, f"no automodule in docs/api for {sorted(missing)}"


def test_the_check_sees_a_missing_module(tmp_path):
    package = tmp_path / "timm_layerscale"
    (package / "models").mkdir(parents=True)
    for name in ("__init__.py", "catalog.py", "models/__init__.py", "models/vit5.py"):
        (package / name).write_text("")
    page = tmp_path / "page.rst"
    page.write_text("Models\n======\n\n.. automodule:: timm_layerscale.models.vit5\n   :no-members:\n")
    assert _modules(package) - _documented([page]) == {"timm_layerscale.catalog"}
