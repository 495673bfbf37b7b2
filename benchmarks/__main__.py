"""Run every ``benchmarks/bench_*.py`` in turn and write ``benchmarks/RESULTS.md``.

Each script runs in its own process from the repository root and prints markdown
tables; this runner collects them under a header that names the machine and the
versions, so the file can be compared with a later run. Scripts that accept
``--quick`` get it with ``--quick``. The file is written to a temporary name and
renamed, so an interrupted run leaves the previous results in place.

Usage::

    python -m benchmarks [--quick] [--only NAME ...] [--output PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from timm_layerscale.machine import cpu_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def scripts(only: Optional[List[str]] = None) -> List[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        wanted = {n if n.endswith(".py") else f"{n}.py" for n in only}
        wanted |= {f"bench_{n}" for n in wanted if not n.startswith("bench_")}
        found = [p for p in found if p.name in wanted]
    return found


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _load() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def machine_lines() -> List[str]:
    import timm
    import torch

    sys.path.insert(0, str(ROOT))
    try:
        from timm_layerscale import __version__ as ours
    finally:
        sys.path.pop(0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- CPU: {cpu_model()}, {cores} cores available to this process ({os.cpu_count()} logical CPUs); "
        f"memory {_memory_gib()}",
        f"- OS: {platform.platform()}",
        f"- Python {platform.python_version()}, torch {torch.__version__} "
        f"(MKL {torch.backends.mkl.is_available()}, oneDNN {torch.backends.mkldnn.is_available()}), "
        f"timm {timm.__version__}, timm-layerscale {ours}",
        f"- load average (1 / 5 / 15 min) at start: {_load()}",
    ]


def run_script(path: Path, quick: bool) -> tuple[List[str], int]:
    cmd = [sys.executable, str(path.relative_to(ROOT))]
    if quick and "--quick" in path.read_text():
        cmd.append("--quick")
    shown = "python " + " ".join(cmd[1:])
    print(f"== {shown}", file=sys.stderr, flush=True)
    load_before = _load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    lines = [
        f"## {path.name}",
        "",
        f"`{shown}`: {wall:.0f} s, exit {proc.returncode}; load average before {load_before}, after {_load()}.",
        "",
        proc.stdout.rstrip(),
        "",
    ]
    if proc.returncode != 0:
        lines.insert(4, f"**failed with exit status {proc.returncode}** (its error output went to the console)\n")
    return lines, proc.returncode


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to the scripts that take it")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scripts (inference, bench_flops.py, ...)")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md", help="where to write the results")
    args = parser.parse_args(argv)
    todo = scripts(args.only)
    if not todo:
        print("no benchmark script matched", file=sys.stderr)
        return 2
    body = [
        "# Benchmark results",
        "",
        f"Produced by `make bench` (`python -m benchmarks{' --quick' if args.quick else ''}`); every figure below "
        "comes from the script named in its section. The machine may be shared: the load averages "
        "show how busy it was.",
        "",
        *machine_lines(),
        "",
    ]
    failed = 0
    for path in todo:
        lines, rc = run_script(path, args.quick)
        body += lines
        failed += rc != 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".md", dir=args.output.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(body).rstrip() + "\n")
        os.replace(tmp, args.output)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"wrote {args.output}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
