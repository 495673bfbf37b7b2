"""The compatibility matrix agrees with what the package declares, and reads pytest's summary."""

from __future__ import annotations

from importlib.metadata import requires, version

from packaging.requirements import Requirement
from packaging.version import Version

from compat.__main__ import (
    CELLS,
    LIBRARY_NEWEST,
    LIBRARY_OLDEST,
    TIMM_NEWEST,
    TIMM_OLDEST,
    TORCH_NEWEST,
    TORCH_OLDEST,
    _counts,
)


def test_declared_floors_are_the_oldest_tested_releases():
    requirements = requires("timm-layerscale")
    assert requirements is not None
    declared = {r.name: str(r.specifier) for r in map(Requirement, requirements) if not r.marker}
    assert declared["timm"] == f">={TIMM_OLDEST}"
    assert declared["torch"] == f">={TORCH_OLDEST[0]}"
    for name, oldest in LIBRARY_OLDEST:
        assert declared[name] == f">={oldest}"


def test_matrix_crosses_both_ends_of_both_ranges():
    pairs = {(c.timm, c.torch, c.torchvision) for c in CELLS}
    assert pairs == {(t, *v) for t in (TIMM_OLDEST, TIMM_NEWEST) for v in (TORCH_OLDEST, TORCH_NEWEST)}
    assert len({c.name for c in CELLS}) == len(CELLS) == 4
    newest = next(c for c in CELLS if (c.timm, c.torch) == (TIMM_NEWEST, TORCH_NEWEST[0]))
    assert newest.libraries == LIBRARY_NEWEST and all(c.libraries == LIBRARY_OLDEST for c in CELLS if c is not newest)
    # the newest cell runs what a fresh install (make test's environment) gets: huggingface_hub 2.x, safetensors 0.8
    assert all(Version(version(name)) >= Version(newest) for name, newest in LIBRARY_NEWEST)


def test_counts_read_the_pytest_summary(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text(
        "....F.\n=== short test summary info ===\nFAILED tests/x.py::y\n"
        "1 failed, 73 passed, 2 skipped, 375 deselected, 1 error in 478.12s (0:07:58)\n"
    )
    assert _counts(log) == {"failed": 1, "passed": 73, "skipped": 2, "deselected": 375, "error": 1}
    log.write_text("no summary here\n")
    assert _counts(log) == {}
