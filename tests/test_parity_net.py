"""The parity net: exact parity under what varies between users (``tests/parity_net_check.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_exact_attention import run_under_dispatch
from timm_layerscale.cli import main as cli_main

#: Setting -> (CPU kernel dispatch, threads, scope, device, fp32 matmul precision).
SETTINGS = {
    "default-threads": ("best", "default", "full", "cpu", "highest"),
    "one-thread": ("best", "1", "core", "cpu", "highest"),
    # a server's count: the kernels split their work by the thread count, not by this machine's cores
    "sixteen-threads": ("best", "16", "core", "cpu", "highest"),
    "aten-default": ("aten-default", "default", "core", "cpu", "highest"),
    "aten-avx2-mkl-avx2": ("aten-avx2-mkl-avx2", "default", "core", "cpu", "highest"),
    "fp32-matmul-medium": ("best", "default", "core", "cpu", "medium"),
    "cuda": ("best", "default", "full", "cuda", "highest"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Official-layout files of the three families, their conversions, and exported CaiT and DeiT-III folders."""
    from parity_net_check import prepare

    return prepare(tmp_path_factory.mktemp("parity-net"))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_parity_net(setting: str, workdir: Path) -> None:
    dispatch, threads, scope, device, precision = SETTINGS[setting]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    args = (str(workdir), scope, threads, device, precision)
    # MKL would otherwise use no more threads than this machine has cores
    env = {"MKL_DYNAMIC": "FALSE"} if threads != "default" else None
    result = run_under_dispatch(dispatch, "parity_net_check.py", *args, timeout=900, env=env)
    if threads != "default":
        assert result["threads"] == int(threads)
    assert result["fp32_matmul_precision"] == precision
    results = result["results"]
    families = {case.split()[0] for case in results}
    assert families == ({"cait", "deit3"} if scope == "full" else {"cait"})
    # per family: fused on and off x (13 or 5 cases, CaiT's buffered path on 7 or 4), then the offsets
    expected = 2 * (13 + 13 + 7) + 8 * 3 * 2 if scope == "full" else 2 * (5 + 4) + 2
    assert len(results) == expected
    failed = {case: d for case, d in results.items() if d != 0.0}
    assert not failed, f"not bit-exact ({result['capability']}, {result['threads']} threads): {failed}"
    if scope == "full":
        verdicts = result["vit5_verdicts"]
        assert len(verdicts) == 4 + 4
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
