"""Start-up of the command line: ``--help`` and an argument error, which must not import torch.

Run: ``python benchmarks/bench_cli_startup.py [--repeats N]``. Prints a markdown table of
median wall times (each command in a fresh process, runs interleaved) against the 0.3 s
target, and whether torch was imported.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

TARGET_S = 0.3
COMMANDS = {
    "timm-layerscale --help": ["-m", "timm_layerscale", "--help"],
    "timm-layerscale convert (missing arguments)": ["-m", "timm_layerscale", "convert"],
    "python -c pass (interpreter floor)": ["-c", "pass"],
}
PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['timm-layerscale', '--help']\n"
    "try:\n"
    "    runpy.run_module('timm_layerscale', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    "print('torch' in sys.modules, 'timm' in sys.modules, file=sys.stderr)\n"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    a = parser.parse_args(argv)
    repeats = 5 if a.quick else a.repeats
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(repeats):
        for label, args in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], capture_output=True)
            times[label].append(time.perf_counter() - t0)
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    imported = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "?"
    print(f"median of {repeats} interleaved runs, fresh process each\n")
    print("| command | median s | target | met |")
    print("|---|---:|---:|---|")
    for label, ts in times.items():
        med = statistics.median(ts)
        if label.startswith("python"):
            print(f"| {label} | {med:.3f} | - | - |")
        else:
            print(f"| {label} | {med:.3f} | < {TARGET_S} | {'yes' if med < TARGET_S else 'no'} |")
    torch_loaded, timm_loaded = (imported.split() + ["?", "?"])[:2]
    print(f"\n`--help` imports torch: {torch_loaded}; imports timm: {timm_loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
