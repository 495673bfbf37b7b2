"""The parity net: exact parity under what varies between users (``tests/parity_net_check.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from test_exact_attention import run_under_dispatch
from timm_layerscale.cli import main as cli_main

pytestmark = pytest.mark.full  # make test leaves this file to make test-full

#: Setting -> (CPU kernel dispatch, device, scope, threads, fp32 matmul precision). The settings of one
#: dispatch and device run in one interpreter, one after another (:func:`net_runs`).
SETTINGS = {
    "default-threads": ("best", "cpu", "full", "default", "highest"),
    "one-thread": ("best-mkl-static", "cpu", "core", "1", "highest"),
    # a server's count: the kernels split their work by the thread count, not by this machine's cores
    "sixteen-threads": ("best-mkl-static", "cpu", "core", "16", "highest"),
    "fp32-matmul-medium": ("best-mkl-static", "cpu", "core", "default", "medium"),
    "aten-default": ("aten-default", "cpu", "core", "default", "highest"),
    "aten-avx2-mkl-avx2": ("aten-avx2-mkl-avx2", "cpu", "core", "default", "highest"),
    "cuda": ("best", "cuda", "full", "default", "highest"),
}


SCRIPT = "parity_net_check.py"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Official-layout files of the three families, their conversions, and exported CaiT and DeiT-III folders."""
    from parity_net_check import prepare

    return prepare(tmp_path_factory.mktemp("parity-net"))


@pytest.fixture(scope="module")
def net_runs(workdir: Path) -> Callable[[str], dict[str, Any]]:
    """A setting's result, from one run of the net per dispatch and device over all of their settings."""
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def result(setting: str) -> dict[str, Any]:
        dispatch, device, *rest = SETTINGS[setting]
        if (dispatch, device) not in done:
            group = [":".join(v[2:]) for v in SETTINGS.values() if v[:2] == (dispatch, device)]
            static = dispatch == "best-mkl-static"  # MKL would otherwise use no more threads than there are cores
            env = {"MKL_DYNAMIC": "FALSE"} if static else None
            args = (str(workdir), device, *group)
            done[dispatch, device] = run_under_dispatch("best" if static else dispatch, SCRIPT, *args, env=env)
        return {"capability": done[dispatch, device]["capability"], **done[dispatch, device]["runs"][":".join(rest)]}

    return result


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_parity_net(setting: str, net_runs: Callable[[str], dict[str, Any]]) -> None:
    _, device, scope, threads, precision = SETTINGS[setting]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    result = net_runs(setting)
    if threads != "default":
        assert result["threads"] == int(threads)
    assert result["fp32_matmul_precision"] == precision
    results = result["results"]
    families = {case.split()[0] for case in results}
    assert families == ({"cait", "deit3"} if scope == "full" else {"cait"})
    # fused on (CaiT 13 or 3 cases, its buffered path on 7 or 2; DeiT-III 3) and off (their 5 or 3 batch cases,
    # 4 or 2 buffered; 3), then the offsets: each through a file and a folder, 0 and 8 through verify (per
    # family), or 0 and 8 through a file
    expected = (13 + 7) + (5 + 4) + 2 * 3 + 2 * (8 * 2 + 2) if scope == "full" else 2 * (3 + 2) + 2
    assert len(results) == expected
    failed = {case: d for case, d in results.items() if d != 0.0}
    assert not failed, f"not bit-exact ({result['capability']}, {result['threads']} threads): {failed}"
    if scope == "full":
        verdicts = result["vit5_verdicts"]
        assert len(verdicts) == 2 + 4
        assert all(v for case, v in verdicts.items() if "exact=True" not in case), verdicts
        assert len({v for case, v in verdicts.items() if "exact=True" in case}) == 1, verdicts


def test_cli_verify_batch_size_1_at_a_misaligned_offset(workdir: Path, tmp_path: Path, capsys) -> None:
    """``verify --batch-size 1`` on a file whose data starts at 8 mod 16: bit-exact, exit 0."""
    from parity_net_check import write_at_offset

    file = write_at_offset(workdir / "cait.safetensors", tmp_path / "cait.safetensors", 8)
    code = cli_main(["-q", "verify", str(workdir / "cait.pth"), str(file), "--num-inputs", "3", "--batch-size", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS (bit-exact)" in out
