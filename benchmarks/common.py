"""What every benchmark script needs: the machine's name, one timed run, and its section of RESULTS.md."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; elsewhere what :mod:`platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``a / b / c``."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine() -> str:
    """One line naming the CPU, the cores this process may use, Python and torch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import torch

        versions = f"torch {torch.__version__}"
    except ImportError:
        versions = "no torch"
    return f"CPU: {cpu_model()}, {cores} cores available; {platform.platform()}; Python {platform.python_version()}, {versions}"


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``argv`` in a fresh process; return its wall time (s) and peak anonymous memory (MiB).

    ``RssAnon`` of ``/proc/PID/status``, sampled every millisecond: the program's own memory, without
    the pages of a memory-mapped file, which belong to the page cache.
    """
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    peak = 0
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as f:
                peak = max(peak, next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0))
        except OSError:  # it ended between the poll and the read
            pass
        time.sleep(0.001)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, argv)
    return wall, peak / 1024


def repo_env() -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``, for the commands a benchmark runs."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_each(
    commands: Mapping[str, list[str]], repeats: int, env: dict[str, str], prepare: Callable[[], None]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each command ``repeats`` times in turn, each in a fresh process (:func:`run_once`) after ``prepare()``, dirty
    pages flushed before and after: the wall seconds and peak ``RssAnon`` MiB of every run, by command."""
    wall: dict[str, list[float]] = {name: [] for name in commands}
    rss: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, argv in commands.items():
            prepare()
            os.sync()
            seconds, peak = run_once(argv, env)
            os.sync()
            wall[name].append(seconds)
            rss[name].append(peak)
    return wall, rss


def write_section(name: str, body: str, command: str, seconds: float, load_before: str) -> None:
    """Replace the section ``name`` of ``benchmarks/RESULTS.md`` (or add it in name order); others are kept.

    The section names the command, when it ran, how long it took, the machine and the
    load averages before and after. ``TIMM_LAYERSCALE_BENCH_RESULTS`` names another file.
    """
    results = Path(os.environ.get("TIMM_LAYERSCALE_BENCH_RESULTS", RESULTS))
    when = datetime.datetime.now(datetime.timezone.utc)
    section = (
        f"## {name}\n\n`{command}` ({when:%Y-%m-%d %H:%M} UTC): {seconds:.0f} s; "
        f"load average before {load_before}, after {load_average()}.\n\n{machine()}\n\n{body}\n"
    )
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    starts = [i + 1 for i in range(len(text)) if text.startswith("\n## ", i)]
    titles = [text[i + 3 : text.index("\n", i)] for i in starts]
    if name in titles:
        start = starts[titles.index(name)]
        end = next((i for i in starts if i > start), len(text))
        text = text[:start] + section + ("\n" if end < len(text) else "") + text[end:]
    else:
        later = next((i for i, title in zip(starts, titles, strict=True) if title > name), None)
        text = text.rstrip("\n") + "\n\n" + section if later is None else text[:later] + section + "\n" + text[later:]
    tmp = results.with_name(f".{results.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, results)
    print(f"wrote the {name} section of {results}", file=sys.stderr)


def record(script: str, main: Callable[[list[str]], int]) -> int:
    """Run a benchmark's ``main`` on the command line's arguments, print its tables and write its section.

    The section is named for ``script`` (the file) and written only when ``main`` returns 0
    or its tables are there to show a missed target (exit 1).
    """
    argv = sys.argv[1:]
    start, before = time.perf_counter(), load_average()
    tables = io.StringIO()
    try:
        with contextlib.redirect_stdout(tables):
            code = main(argv)
    finally:  # --help exits from inside main
        print(tables.getvalue(), end="")
    name = Path(script).name
    if code in (0, 1) and tables.getvalue().strip():
        command = " ".join(["python", f"benchmarks/{name}", *argv])
        write_section(name, tables.getvalue().strip(), command, time.perf_counter() - start, before)
    return code
