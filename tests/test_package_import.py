"""``import timm_layerscale``: cheap, and it always registers the models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _run(code: str, **env: str) -> str:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_loads_neither_torch_nor_timm():
    code = "import sys, timm_layerscale; print('torch' in sys.modules, 'timm' in sys.modules)"
    assert _run(code) == "False False"


@pytest.mark.parametrize(("order", "switch"), [("timm_layerscale, timm", "0"), ("timm, timm_layerscale", "1")])
def test_explicit_import_registers_whatever_the_switch(order, switch):
    code = f"import {order}; m = timm.create_model('cait_xxs24_224_ls', device='meta'); print(type(m).__name__)"
    assert _run(code, TIMM_LAYERSCALE_AUTOLOAD=switch) == "CaitLS"


def test_public_names_load_on_first_use_and_dir_lists_only_them():
    code = (
        "import sys, timm_layerscale as t; print('torch' in sys.modules); "
        "ls = t.LayerScale(4); print(type(ls).__name__, callable(t.param_groups), callable(t.fold_layerscale)); "
        "print(dir(t) == sorted(t.__all__))"
    )
    assert _run(code).splitlines() == ["False", "LayerScale True True", "True"]


@pytest.mark.parametrize("first", ["timm_layerscale.parity.compare"])
def test_any_module_imported_first_registers_the_models_cleanly(first):
    # A module that imports timm while the models import it back must not break registration.
    code = f"import {first}, timm; print(len(timm.list_models('*_ls')))"
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], env=full, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "10", out.stderr
