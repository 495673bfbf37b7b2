"""The test suite itself: a passing run leaves nothing on the disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.full
def test_a_passing_run_leaves_no_temporary_files(tmp_path):
    # A run with this project's settings and set-up, its temporary folder redirected to look at.
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", inner)
    (inner / "test_writes.py").write_text(
        "def test_writes(tmp_path):\n    (tmp_path / 'weights.bin').write_bytes(bytes(1 << 20))\n"
    )
    temp = tmp_path / "temp"
    temp.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    cmd += ["--rootdir", str(inner), str(inner)]
    proc = subprocess.run(cmd, env=dict(os.environ, TMPDIR=str(temp)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    # pytest's own folder for the user stays, empty.
    left = [str(p.relative_to(temp)) for p in temp.rglob("*") if not (p.is_dir() and p.name.startswith("pytest-of-"))]
    assert left == []
