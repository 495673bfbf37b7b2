"""``import timm_layerscale``: cheap, and it always registers the models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.full  # make test leaves this file to make test-full

CREATE = "m = timm.create_model('cait_xxs24_224_ls', device='meta'); print(type(m).__name__)"
#: What each fresh interpreter runs (with ``-W error``), and its environment.
RUNS = {
    "neither": ("import sys, timm_layerscale; print('torch' in sys.modules, 'timm' in sys.modules)", {}),
    "timm_layerscale, timm 0": (f"import timm_layerscale, timm; {CREATE}", {"TIMM_LAYERSCALE_AUTOLOAD": "0"}),
    "timm, timm_layerscale 1": (f"import timm, timm_layerscale; {CREATE}", {"TIMM_LAYERSCALE_AUTOLOAD": "1"}),
    "lazy": (
        "import sys, timm_layerscale as t; print('torch' in sys.modules); ls = t.LayerScale(4); "
        "print(type(ls).__name__, callable(t.param_groups), callable(t.fold_layerscale), dir(t) == sorted(t.__all__))",
        {},
    ),
    # A module that imports timm while the models import it back must not break registration.
    "first": ("import timm_layerscale.parity.compare, timm; print(len(timm.list_models('*_ls')))", {}),
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """Each of :data:`RUNS` in a fresh interpreter, all at once (they mostly import): its standard output."""
    started = {
        key: subprocess.Popen(
            [sys.executable, "-W", "error", "-c", code],
            env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, (code, env) in RUNS.items()
    }
    done = {key: (proc.communicate(timeout=300), proc.returncode) for key, proc in started.items()}
    assert all(code == 0 for _, code in done.values()), {k: err for k, ((_, err), code) in done.items() if code}
    return {key: out.strip() for key, ((out, _), _) in done.items()}


def test_import_loads_neither_torch_nor_timm(outputs):
    assert outputs["neither"] == "False False"


@pytest.mark.parametrize("run", ["timm_layerscale, timm 0", "timm, timm_layerscale 1"])
def test_explicit_import_registers_whatever_the_switch(outputs, run):
    assert outputs[run] == "CaitLS"


def test_public_names_load_on_first_use_and_dir_lists_only_them(outputs):
    assert outputs["lazy"].splitlines() == ["False", "LayerScale True True True"]


def test_any_module_imported_first_registers_the_models_cleanly(outputs):
    from timm_layerscale.families import VARIANTS

    assert outputs["first"] == str(sum(v.name.endswith("_ls") for v in VARIANTS))  # every family's models named _ls
