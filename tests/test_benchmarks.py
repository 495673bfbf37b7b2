"""The benchmark scripts start as documented, without measuring (the measurements are `make bench`'s)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import ROOT

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_writes_nothing(script):
    before = RESULTS.read_bytes()
    done = _run(f"benchmarks/{script}", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script}") and "--help" in done.stdout
    assert RESULTS.read_bytes() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures where CUDA is present")
@pytest.mark.full
def test_bench_cuda_without_cuda_says_so_and_measures_nothing():
    before = RESULTS.read_bytes()
    done = _run("benchmarks/bench_cuda.py", "--quick")
    assert done.returncode == 0 and done.stdout == ""
    assert done.stderr == "bench_cuda: no CUDA device here; nothing measured\n"
    assert RESULTS.read_bytes() == before
