"""Run every ``benchmarks/bench_*.py`` in turn; each writes its own section of ``benchmarks/RESULTS.md``.

Each script runs in its own process from the repository root, prints its tables and
replaces its section of the file (naming the command, the time, the machine and the
load averages), so one script can be run again alone. Scripts that accept ``--quick``
get it with ``--quick``.

Usage::

    python -m benchmarks [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts(only: list[str] | None = None) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        wanted = {n if n.endswith(".py") else f"{n}.py" for n in only}
        wanted |= {f"bench_{n}" for n in wanted if not n.startswith("bench_")}
        found = [p for p in found if p.name in wanted]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to the scripts that take it")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these scripts (inference, bench_flops.py, ...)"
    )
    args = parser.parse_args(argv)
    todo = scripts(args.only)
    if not todo:
        print("no benchmark script matched", file=sys.stderr)
        return 2
    failed = []
    for path in todo:
        cmd = [sys.executable, str(path.relative_to(HERE.parent))]
        if args.quick and "--quick" in path.read_text():
            cmd.append("--quick")
        print(f"== python {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        if subprocess.run(cmd, cwd=HERE.parent).returncode != 0:
            failed.append(path.name)
    if failed:
        print(f"failed or missed a target: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
