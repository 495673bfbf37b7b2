"""Run the compatibility subset of the tests against the oldest and newest supported timm and torch.

The matrix crosses the oldest and the newest supported timm with the oldest and the newest
supported torch (each with the torchvision release made for it). Every cell gets its own
virtual environment under ``.compat/NAME``, created with this interpreter and filled from
the package index: exactly the pinned torch, torchvision, timm, huggingface_hub and safetensors
(the last two at their oldest supported releases, in the newest cell at the newest tested, which
a fresh install gets), then this project in editable mode with its ``test`` extra. In it, ``pytest -m "compat and not slow"`` runs the tests marked
``@pytest.mark.compat``. The pins are passed to pip as its constraints file (``PIP_CONSTRAINT``),
which replaces any constraints file of the machine's pip configuration for these installs only.

An environment is reused when its recorded pins and ``pyproject.toml`` are unchanged
(``--fresh`` rebuilds it; ``--remove`` deletes it after its run). The result table goes to
stdout, and, when every cell ran, to ``compat/RESULTS.md`` with the machine and the date.
The exit status is 0 only when every cell installed and passed.

Usage::

    python -m compat [--only NAME ...] [--fresh] [--remove] [--list] [--output PATH]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import cpu_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENVS = ROOT / ".compat"
RESULTS = HERE / "RESULTS.md"
PYTEST_MARKERS = "compat and not slow"


@dataclass(frozen=True)
class Cell:
    """One environment of the matrix: exact timm, torch and torchvision releases."""

    name: str
    timm: str
    torch: str
    torchvision: str
    libraries: tuple[tuple[str, str], ...] = ()

    def pins(self) -> list[str]:
        return [
            f"torch=={self.torch}",
            f"torchvision=={self.torchvision}",
            f"timm=={self.timm}",
            *(f"{name}=={version}" for name, version in self.libraries),
        ]


#: The supported range. The oldest timm is the first whose ``local-dir:`` loader reads a folder's
#: ``model.safetensors`` (what ``export`` writes; layers take ``device``/``dtype`` from 1.0.21);
#: the oldest torch is the first with ``torch.serialization.safe_globals`` (training checkpoints
#: carry an argparse.Namespace).
#: torchvision is the release made for each torch (0.29.2 requires torch>=2.14).
TIMM_OLDEST, TIMM_NEWEST = "1.0.26", "1.0.31"
#: The oldest supported huggingface_hub and safetensors: huggingface_hub 1.0 to 1.2 lack
#: ``constants.is_offline_mode``, and 1.31 is the oldest transformers 5 accepts; safetensors 0.7.0 is the
#: first that writes and reads complex tensors. The newest cell runs the newest tested, which a fresh
#: install gets (huggingface_hub 2.x, whose HTTP client is httpx2).
LIBRARY_OLDEST = (("huggingface_hub", "1.31.0"), ("safetensors", "0.7.0"))
LIBRARY_NEWEST = (("huggingface_hub", "2.4.0"), ("safetensors", "0.8.0"))
TORCH_OLDEST, TORCH_NEWEST = ("2.5.1", "0.20.1"), ("2.15.0", "0.29.2")

CELLS = [
    Cell("oldest", TIMM_OLDEST, *TORCH_OLDEST, LIBRARY_OLDEST),
    Cell("timm-oldest", TIMM_OLDEST, *TORCH_NEWEST, LIBRARY_OLDEST),
    Cell("torch-oldest", TIMM_NEWEST, *TORCH_OLDEST, LIBRARY_OLDEST),
    Cell("newest", TIMM_NEWEST, *TORCH_NEWEST, LIBRARY_NEWEST),
]


@dataclass
class Outcome:
    cell: Cell
    ok: bool = False
    status: str = "not run"
    versions: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    install_s: float | None = None
    test_s: float | None = None


def _env(venv: Path | None = None, **extra: str) -> dict:
    """This environment without what would make a child use another interpreter's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    if venv is not None:
        env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _stamp(cell: Cell) -> str:
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return json.dumps({"pins": cell.pins(), "python": sys.version.split()[0], "pyproject": pyproject})


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _install(cell: Cell, venv: Path, fresh: bool) -> tuple[bool, str]:
    """Create the cell's environment (or reuse it); return (ok, reason)."""
    stamp = venv / ".compat-stamp"
    if not fresh and stamp.is_file() and stamp.read_text() == _stamp(cell):
        return True, "reused"
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("".join(p + "\n" for p in cell.pins()))
    python = venv / "bin" / "python"
    log = venv / "install.log"
    cmd = [
        str(python),
        "-m",
        "pip",
        "install",
        "--progress-bar",
        "off",
        *cell.pins(),
        "setuptools>=77",
        "-e",
        ".[test]",
    ]
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(venv, PIP_CONSTRAINT=str(constraints)), stdout=f, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        return False, f"pip install exited {proc.returncode}; see {log.relative_to(ROOT)}:\n{_tail(log)}"
    stamp.write_text(_stamp(cell))
    return True, "installed"


#: Run in a cell's interpreter: its Python and the version of each package named in its arguments.
_VERSIONS = (
    "import importlib, json, platform, sys; print(json.dumps({'python': platform.python_version(), "
    "**{name: importlib.import_module(name).__version__ for name in sys.argv[1:]}}))"
)


def _versions(venv: Path, names: list[str]) -> tuple[dict | None, str]:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _VERSIONS, *names],
        cwd=venv,
        env=_env(venv),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return None, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def _counts(log: Path) -> dict:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if re.search(r" in [\d.]+s", line) and _SUMMARY.search(line):
            return {
                kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _SUMMARY.findall(line)
            }
    return {}


def run_cell(cell: Cell, fresh: bool, remove: bool) -> Outcome:
    out = Outcome(cell)
    venv = VENVS / cell.name
    VENVS.mkdir(exist_ok=True)
    print(f"[{cell.name}] timm {cell.timm}, torch {cell.torch}, torchvision {cell.torchvision}", flush=True)
    try:
        t0 = time.perf_counter()
        ok, reason = _install(cell, venv, fresh)
        out.install_s = time.perf_counter() - t0
        if not ok:
            out.status = "install failed"
            print(f"[{cell.name}] {reason}", flush=True)
            return out
        print(f"[{cell.name}] environment {reason} in {out.install_s:.0f} s", flush=True)
        expected = dict(pin.split("==") for pin in cell.pins())
        versions, error = _versions(venv, list(expected))
        if versions is None:
            out.status = f"import failed: {error}"
            print(f"[{cell.name}] {out.status}", flush=True)
            return out
        out.versions = versions
        wrong = [f"{k} {versions[k]} (wanted {v})" for k, v in expected.items() if versions[k].split("+")[0] != v]
        if wrong:
            out.status = "wrong versions: " + ", ".join(wrong)
            print(f"[{cell.name}] {out.status}", flush=True)
            return out
        log = venv / "pytest.log"
        cmd = [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-m",
            PYTEST_MARKERS,
            "-p",
            "no:cacheprovider",
            "--durations=10",
        ]
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=_env(venv), stdout=f, stderr=subprocess.STDOUT)
        out.test_s = time.perf_counter() - t0
        out.counts = _counts(log)
        out.ok = proc.returncode == 0 and out.counts.get("passed", 0) > 0
        out.status = "pass" if out.ok else f"FAIL (pytest exit {proc.returncode})"
        summary = ", ".join(f"{n} {k}" for k, n in out.counts.items()) or "no summary"
        print(f"[{cell.name}] {out.status}: {summary} in {out.test_s:.0f} s", flush=True)
        if not out.ok:
            print(_tail(log, 60), flush=True)
        return out
    finally:
        if remove and venv.exists():
            shutil.rmtree(venv, ignore_errors=True)


def table(outcomes: list[Outcome]) -> str:
    rows = [
        "| timm | torch | torchvision | huggingface_hub | safetensors | result | passed | failed | skipped "
        "| install s | tests s |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        v, c, libs = o.versions or {}, o.counts, dict(o.cell.libraries)
        rows.append(
            f"| {v.get('timm', o.cell.timm)} | {v.get('torch', o.cell.torch)} | {v.get('torchvision', o.cell.torchvision)} "
            f"| {v.get('huggingface_hub', libs['huggingface_hub'])} | {v.get('safetensors', libs['safetensors'])} "
            f"| {o.status} | {c.get('passed', 0)} | {c.get('failed', 0) + c.get('error', 0)} | {c.get('skipped', 0)} "
            f"| {'' if o.install_s is None else f'{o.install_s:.0f}'} | {'' if o.test_s is None else f'{o.test_s:.0f}'} |"
        )
    return "\n".join(rows)


def write_results(outcomes: list[Outcome], path: Path) -> None:
    python = next((o.versions["python"] for o in outcomes if o.versions), platform.python_version())
    text = (
        "# Compatibility matrix\n\n"
        f"`python -m compat` (`make test-compat`) on {datetime.date.today().isoformat()}: "
        f"{cpu_model()}, {os.cpu_count()} CPUs, Linux, Python {python}. Each row is a fresh "
        f'environment running `pytest -m "{PYTEST_MARKERS}"`; install time includes downloads.\n\n'
        + table(outcomes)
        + "\n"
    )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", choices=[c.name for c in CELLS], help="run these cells only"
    )
    parser.add_argument("--fresh", action="store_true", help="rebuild environments even when their pins are unchanged")
    parser.add_argument("--remove", action="store_true", help="delete each environment after its run")
    parser.add_argument("--list", action="store_true", help="print the matrix and exit")
    parser.add_argument(
        "--output",
        type=Path,
        help=f"write the result table here (default: {RESULTS.relative_to(ROOT)} when every cell runs)",
    )
    args = parser.parse_args(argv)
    cells = [c for c in CELLS if not args.only or c.name in args.only]
    if args.list:
        for c in cells:
            libs = ", ".join(f"{name} {version}" for name, version in c.libraries)
            print(f"{c.name:13} timm {c.timm:7} torch {c.torch:7} torchvision {c.torchvision:7} {libs}")
        return 0
    t0 = time.perf_counter()
    outcomes = [run_cell(c, args.fresh, args.remove) for c in cells]
    print()
    print(table(outcomes))
    print(f"\n{sum(o.ok for o in outcomes)} of {len(outcomes)} environments passed in {time.perf_counter() - t0:.0f} s")
    output = args.output or (RESULTS if len(cells) == len(CELLS) else None)
    if output is not None:
        write_results(outcomes, output)
        print(f"results written to {output}")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
