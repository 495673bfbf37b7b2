"""Sphinx configuration of the timm-layerscale documentation."""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))
# Building the pages never downloads anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from timm_layerscale._version import __version__  # noqa: E402

project = "timm-layerscale"
author = "timm-layerscale contributors"
copyright = "timm-layerscale contributors"
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "myst_parser",
    "sphinxarg.ext",
    "models_table",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_preserve_defaults = True
# A method without a docstring of its own is left out rather than shown with the one of
# torch's nn.Module or argparse's it overrides, which describe another behaviour.
autodoc_inherit_docstrings = False

# Every reference into this package must resolve (a renamed or undocumented name fails the
# build); the standard library's and torch's are not linked, the build reads no inventories.
nitpicky = True
nitpick_ignore_regex = [
    ("py:class", r"(torch|timm|pathlib|os|collections\.abc|argparse|contextlib|typing|concurrent\.futures)\..+"),
    ("py:class", r"timm_layerscale\..+\.[VM]"),  # TypeVars of signatures
    ("py:class", r"dict\[str"),  # a dataclass field's default_factory, split by the signature parser
]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

doctest_global_setup = "import torch\ntorch.manual_seed(0)"

html_theme = "furo"
html_title = f"timm-layerscale {__version__}"
html_static_path: list[str] = []
