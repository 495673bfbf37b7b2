"""What the timm import hook costs at interpreter start-up and at ``import timm``.

Builds this project's wheel and installs it into a scratch virtual environment, next to
a twin environment without it. Both reach torch and timm through a path-only ``.pth``
file naming this interpreter's site-packages (path lines run no start-up code), so the
only difference between them is this project. Runs alternate between the twins; the
markdown table gives medians and, less sensitive to other load on the machine, the
difference between the best runs:

* ``python -X importtime -c pass``: the cumulative import time of :mod:`site`, which
  includes reading every ``.pth`` file and running its ``import`` line, and the hook
  module's own line;
* ``python -c pass`` CPU and wall time, the whole interpreter start and exit;
* ``python -X importtime -c "import timm"``, without the plugin and with the hook, and the
  ``timm_layerscale`` import that the hook adds inside timm's (the same work as an explicit
  ``import timm_layerscale``), plus the CPU time of the whole process;
* ``timm-layerscale --help`` in the environment with the plugin: its wall time, failing
  if it imported torch or timm.

Usage: ``python benchmarks/bench_startup.py [--runs 20] [--timm-runs 5]``
"""

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = "_timm_layerscale_autoload"
#: ``timm-layerscale --help``, failing if it imported torch or timm.
HELP = (
    "import runpy, sys\n"
    "sys.argv = ['timm-layerscale', '--help']\n"
    "try:\n"
    "    runpy.run_module('timm_layerscale', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    "assert not {'torch', 'timm'} & set(sys.modules), 'timm-layerscale --help imported torch or timm'\n"
)


def _environ(**extra: str) -> dict:
    kept = ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED")
    env = {k: v for k, v in os.environ.items() if k in kept or not k.startswith(("PYTHON", "TIMM_LAYERSCALE_"))}
    env.update(extra)
    return env


def _build_wheel(work: Path) -> Path:
    src = work / "project"
    src.mkdir()
    for item in ROOT.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy2(item, src / item.name)
    shutil.copytree(ROOT / "timm_layerscale", src / "timm_layerscale", ignore=shutil.ignore_patterns("__pycache__"))
    if not (src / "README.md").exists():
        (src / "README.md").write_text("timm-layerscale\n")
    dist = work / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        env=_environ(),
    )
    return next(dist.glob("*.whl"))


def _scratch_env(root: Path, wheel: Path | None) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site, "_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    if wheel is not None:
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
            check=True,
            env=_environ(),
        )
    return python


def _run(python: Path, code: str, cwd: Path, env: dict, importtime: bool = False) -> tuple:
    """Wall ms, CPU (user + system) ms and, with ``importtime``, cumulative ms per module."""
    argv = [str(python), *(["-X", "importtime"] if importtime else []), "-c", code]
    before, start = _children_cpu(), time.perf_counter()
    err = subprocess.run(argv, check=True, cwd=cwd, env=env, capture_output=True, text=True).stderr
    wall, cpu = (time.perf_counter() - start) * 1e3, (_children_cpu() - before) * 1e3
    modules = {}
    for line in err.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)", line)
        if m:
            modules[m.group(2)] = int(m.group(1)) / 1e3
    return wall, cpu, modules


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(runs: int, timm_runs: int, work: Path) -> list:
    wheel = _build_wheel(work)
    plain = _scratch_env(work / "plain", None)
    hooked = _scratch_env(work / "hooked", wheel)
    env = _environ()
    samples = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    for python in (plain, hooked):  # warm the file cache
        _run(python, "import timm" if timm_runs else "pass", work, env)
    for _ in range(runs):
        for tag, python in (("plain", plain), ("hooked", hooked)):
            modules = _run(python, "pass", work, env, importtime=True)[2]
            add(f"site-{tag}", modules["site"])
            if python is hooked:
                add("hook", modules[HOOK])
            wall, cpu, _ = _run(python, "pass", work, env)
            add(f"pass-wall-{tag}", wall)
            add(f"pass-cpu-{tag}", cpu)
        add("help", _run(hooked, HELP, work, env)[0])
    for _ in range(timm_runs):
        for tag, python in (("plain", plain), ("hooked", hooked)):
            _, cpu, modules = _run(python, "import timm", work, env, importtime=True)
            add(f"timm-cpu-{tag}", cpu)
            add(f"timm-imports-{tag}", modules["timm"])  # with the hook, this includes the plugin
            if python is hooked:
                add("plugin", modules["timm_layerscale"])
                add("plugin-share", modules["timm_layerscale"] / modules["timm"])

    med = {key: statistics.median(values) for key, values in samples.items()}
    low = {key: min(values) for key, values in samples.items()}

    def row(name: str, key: str, after: str = "hooked") -> tuple:
        before, now = med[f"{key}-plain"], med[f"{key}-{after}"]
        best = low[f"{key}-{after}"] - low[f"{key}-plain"]
        return name, before, now, f"{now - before:+.2f} ms ({(now - before) / before:+.1%})", f"{best:+.2f} ms"

    rows = [
        row("`-X importtime -c pass`: `site` cumulative", "site"),
        (
            f"`-X importtime -c pass`: `{HOOK}` itself",
            None,
            med["hook"],
            f"{med['hook']:+.2f} ms",
            f"{low['hook']:+.2f} ms",
        ),
        row("`python -c pass`: CPU time", "pass-cpu"),
        row("`python -c pass`: wall time", "pass-wall"),
        ("`timm-layerscale --help`: wall time (no torch, no timm)", None, med["help"], "", ""),
    ]
    if timm_runs:
        plugin = f"{med['plugin']:+.2f} ms ({med['plugin-share']:+.1%})"
        rows += [
            row('`-X importtime -c "import timm"`: `timm` cumulative', "timm-imports"),
            (
                '`-X importtime -c "import timm"`: `timm_layerscale` within it',
                None,
                med["plugin"],
                plugin,
                f"{low['plugin']:+.2f} ms",
            ),
            row('`python -c "import timm"`: CPU time', "timm-cpu"),
        ]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="start-up runs per environment (default 20)")
    parser.add_argument(
        "--timm-runs", type=int, default=5, help="`import timm` runs per variant, 0 to skip (default 5)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        rows = measure(args.runs, args.timm_runs, Path(tmp))
    print(
        f"Python {sys.version.split()[0]}, {args.runs} start-up and {args.timm_runs} `import timm` runs per variant\n"
    )
    print("| measurement | without the plugin (median) | with the hook (median) | added (median) | added (best run) |")
    print("|---|---:|---:|---:|---:|")
    for name, before, after, delta, best in rows:
        before_text = "n/a" if before is None else f"{before:.2f} ms"
        print(f"| {name} | {before_text} | {after:.2f} ms | {delta} | {best} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import record

    sys.exit(record(__file__, main))
