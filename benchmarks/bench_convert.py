"""Time the command-line conversion without verification against ``import torch`` and ``cp``.

Builds the seeded 1.43 GB official-layout checkpoint of ``bench_convert_io.py`` (shapes
of ``M48_448.pth``), then runs, ``--repeats`` times in turn and each in a fresh process
from the same state (source in the page cache, dirty pages flushed):

- ``python -c "import torch"``: the start-up the converter cannot avoid;
- ``cp SOURCE OUT``: the cost of reading and writing the bytes once;
- ``timm-layerscale convert SOURCE OUT.safetensors --no-verify``.

Targets for the conversion: wall time at most ``import torch`` + 2x ``cp``; peak RSS
at most ``import torch`` + 256 MiB. Medians of the runs are compared. The output is also
compared byte for byte with the one the general path writes (tensors read through
torch), once, untimed. The table goes to stdout and, as the ``bench_convert.py``
section, into ``benchmarks/RESULTS.md`` (other sections are kept).

Usage::

    python benchmarks/bench_convert.py [--repeats 5] [--quick] [--workdir DIR] [--results PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_convert_io import build_checkpoint, page_in, run_once, sha256  # noqa: E402

from timm_layerscale.machine import cpu_model  # noqa: E402

GENERAL = """
import sys
from timm_layerscale.conversion import pipeline, stream
stream.SourcePass.prepare = classmethod(lambda cls, *a, **k: None)
pipeline.convert_checkpoint(sys.argv[1], sys.argv[2], verify=False, overwrite=True)
"""


def measure(src: Path, out: Path, repeats: int, env: dict[str, str]) -> dict[str, tuple[list[float], list[float]]]:
    """Wall seconds and peak RSS MiB of each command, run ``repeats`` times in turn."""
    python = sys.executable
    commands = {
        "import torch": [python, "-c", "import torch"],
        "cp": ["cp", str(src), str(out)],
        "convert --no-verify": [
            python,
            "-m",
            "timm_layerscale",
            "convert",
            str(src),
            str(out),
            "--no-verify",
            "--overwrite",
        ],
    }
    found: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in commands}
    digests = set()
    for _ in range(repeats):
        for name, argv in commands.items():
            out.unlink(missing_ok=True)
            page_in(src)
            os.sync()
            wall, peak, _ = run_once(argv, env)
            os.sync()
            found[name][0].append(wall)
            found[name][1].append(peak)
            if name.startswith("convert"):
                digests.add(sha256(out))
    if len(digests) != 1:
        raise SystemExit(f"the conversion wrote different files in different runs: {digests}")
    return found


def report(found: dict[str, tuple[list[float], list[float]]], size: int, repeats: int, identical: bool) -> str:
    wall = {k: statistics.median(v[0]) for k, v in found.items()}
    rss = {k: statistics.median(v[1]) for k, v in found.items()}
    conv = "convert --no-verify"
    wall_limit = wall["import torch"] + 2 * wall["cp"]
    rss_limit = rss["import torch"] + 256
    lines = [
        f"{size / 1e9:.2f} GB official-layout checkpoint; CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"median of {repeats} runs of each, load average now {' / '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "",
        "| command | wall s (median) | wall s (each run) | peak RSS MiB (median) |",
        "|---|---:|---|---:|",
        *(
            f"| {shown} | {wall[name]:.2f} | {' '.join(f'{x:.2f}' for x in found[name][0])} | {rss[name]:.0f} |"
            for name, shown in [
                ("import torch", '`python -c "import torch"`'),
                ("cp", "`cp SOURCE OUT`"),
                (conv, "`timm-layerscale convert SOURCE OUT.safetensors --no-verify`"),
            ]
        ),
        "",
        "| target | measured | limit | measured / limit | met |",
        "|---|---:|---:|---:|---|",
        f"| wall <= import torch + 2x cp | {wall[conv]:.2f} s | {wall_limit:.2f} s | {wall[conv] / wall_limit:.2f} "
        f"| {'yes' if wall[conv] <= wall_limit else 'no'} |",
        f"| peak RSS <= import torch + 256 MiB | {rss[conv]:.0f} MiB | {rss_limit:.0f} MiB | {rss[conv] / rss_limit:.2f} "
        f"| {'yes' if rss[conv] <= rss_limit else 'no'} |",
        "",
        f"time beyond `import torch`: {wall[conv] - wall['import torch']:.2f} s = "
        f"{(wall[conv] - wall['import torch']) / wall['cp']:.2f}x cp (target 2x); "
        f"memory beyond `import torch`: {rss[conv] - rss['import torch']:.0f} MiB (target 256).",
        "",
        f"output byte-identical to the general path's: {'yes' if identical else 'NO'}.",
    ]
    return "\n".join(lines)


def write_section(
    results: Path, body: str, command: str, seconds: float, load_before: str, name: str = Path(__file__).name
) -> None:
    """Replace the section ``name`` (this script's) of ``results``, or add it in name order; others are kept."""
    when = datetime.datetime.now(datetime.timezone.utc)
    section = (
        f"## {name}\n\n`{command}` ({when:%Y-%m-%d %H:%M} UTC, a run of its own): {seconds:.0f} s, exit 0; "
        f"load average before {load_before}, after {' / '.join(f'{x:.2f}' for x in os.getloadavg())}.\n\n{body}\n"
    )
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    starts = [i + 1 for i in range(len(text)) if text.startswith("\n## ", i)]
    titles = [text[i + 3 : text.index("\n", i)] for i in starts]
    if name in titles:
        start = starts[titles.index(name)]
        end = next((i for i in starts if i > start), len(text))
        text = text[:start] + section + ("\n" if end < len(text) else "") + text[end:]
    else:
        end = next((i for i, title in zip(starts, titles, strict=True) if title > name), None)
        if end is None:
            text = text.rstrip("\n") + "\n\n" + section
        else:
            text = text[:end] + section + "\n" + text[end:]
    tmp = results.with_name(f".{results.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command; medians are compared")
    parser.add_argument("--quick", action="store_true", help="2 runs of each")
    parser.add_argument("--workdir", type=Path, help="folder for the big files (default: a new temporary folder)")
    parser.add_argument(
        "--results",
        default=str(HERE / "RESULTS.md"),
        help="markdown file whose bench_convert.py section is replaced; '' for none",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    start, load_before = time.perf_counter(), " / ".join(f"{x:.2f}" for x in os.getloadavg())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir))
    try:
        src, out, general = workdir / "M48_448.pth", workdir / "out.safetensors", workdir / "general.safetensors"
        build_checkpoint(src, 1.43)  # all 48 blocks: the converter must recognise cait_m48_448
        found = measure(src, out, args.repeats, env)
        subprocess.run([sys.executable, "-c", GENERAL, str(src), str(general)], env=env, check=True)
        identical = sha256(out) == sha256(general)
        body = report(found, src.stat().st_size, args.repeats, identical)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(body)
    if args.results and not os.environ.get("TIMM_LAYERSCALE_BENCH_RUNNER"):
        shown = (
            "python benchmarks/bench_convert.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
        )
        write_section(Path(args.results), body, shown, time.perf_counter() - start, load_before)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
