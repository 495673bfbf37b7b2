"""Time and measure converting a large official CaiT checkpoint to safetensors.

Builds a synthetic checkpoint in the official CaiT layout (``{'model': {'module.' + key:
tensor}}``, shapes of ``cait_m48_448``, about 1.43 GB; a smaller ``--size-gb`` uses
fewer blocks), then runs each command in its own process, ``--repeats`` times in
turn, and prints a markdown table of median wall time and peak resident memory.
Python commands that print ``work_s=SECONDS`` (time after their imports) also get
that reported, which is far less noisy than subtracting start-up times.
The source file is read into the page cache before every run and dirty pages are
flushed after it, so every command starts from the same state.

Usage::

    python benchmarks/bench_convert_io.py [--size-gb 1.43] [--repeats 3] [--workdir DIR]

Targets: the streaming converter's wall time beyond start-up is at most 1.5x ``cp``,
and its peak RSS is at most start-up + 256 MiB. To add a command (say, the CLI), add
a :class:`Command` to :func:`commands`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EMBED, HEADS, PATCHES, CLASS_BLOCKS, CLASSES, FULL_DEPTH = 768, 16, 784, 2, 1000, 48

NAIVE = """
import sys, time, torch
from safetensors.torch import save_file
start = time.perf_counter()
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
save_file({k.removeprefix("module."): v for k, v in ckpt["model"].items()}, sys.argv[2], {"format": "pt"})
print(f"work_s={time.perf_counter() - start}")
"""

STREAM = """
import sys, time
from timm_layerscale.conversion.io import load_checkpoint
from timm_layerscale.conversion.save import save_safetensors
start = time.perf_counter()
ckpt = load_checkpoint(sys.argv[1])
save_safetensors(sys.argv[2], {k.removeprefix("module."): v for k, v in ckpt["model"].items()}, {"format": "pt"}, overwrite=True)
print(f"work_s={time.perf_counter() - start}")
"""

CONVERT = """
import sys, time
from timm_layerscale.conversion.pipeline import convert_checkpoint
start = time.perf_counter()
convert_checkpoint(sys.argv[1], sys.argv[2], verify=False, overwrite=True)
print(f"work_s={time.perf_counter() - start}")
"""


@dataclass(frozen=True)
class Command:
    """One benchmarked command.

    Attributes:
        label: Row name in the table.
        argv: Command line; ``{src}`` and ``{out}`` are replaced by the file paths.
        startup: Label of the command whose time and memory count as this one's start-up.
    """

    label: str
    argv: list[str]
    startup: str | None = None


def commands(python: str) -> list[Command]:
    """The benchmarked commands, in table order."""
    return [
        Command("cp", ["cp", "{src}", "{out}"]),
        # Every command needs torch; the converter without verification needs nothing of timm.
        Command("start-up: import torch, safetensors", [python, "-c", "import torch, safetensors"]),
        Command("naive: torch.load + save_file", [python, "-c", NAIVE, "{src}", "{out}"],
                "start-up: import torch, safetensors"),
        Command("stream: load_checkpoint (mmap) + save_safetensors", [python, "-c", STREAM, "{src}", "{out}"],
                "start-up: import torch, safetensors"),
        Command("converter: convert_checkpoint(verify=False)", [python, "-c", CONVERT, "{src}", "{out}"],
                "start-up: import torch, safetensors"),
        Command("CLI: timm-layerscale convert --no-verify",
                [python, "-m", "timm_layerscale", "convert", "{src}", "{out}", "--no-verify", "--overwrite"],
                "start-up: import torch, safetensors"),
    ]


def cait_shapes(depth: int) -> list[tuple[str, tuple[int, ...]]]:
    """Official CaiT keys and shapes (without the ``module.`` prefix) for ``depth`` blocks."""
    d, h = EMBED, HEADS
    shapes = [("cls_token", (1, 1, d)), ("pos_embed", (1, PATCHES, d)),
              ("patch_embed.proj.weight", (d, 3, 16, 16)), ("patch_embed.proj.bias", (d,))]

    def linear(name: str, n_out: int, n_in: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (n_out, n_in)), (f"{name}.bias", (n_out,))]

    def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (d,)), (f"{name}.bias", (d,))]

    for i in range(depth):
        p = f"blocks.{i}."
        shapes += [(p + "gamma_1", (d,)), (p + "gamma_2", (d,)), *norm(p + "norm1"),
                   *linear(p + "attn.qkv", 3 * d, d), *linear(p + "attn.proj", d, d),
                   *linear(p + "attn.proj_l", h, h), *linear(p + "attn.proj_w", h, h), *norm(p + "norm2"),
                   *linear(p + "mlp.fc1", 4 * d, d), *linear(p + "mlp.fc2", d, 4 * d)]
    for j in range(CLASS_BLOCKS):
        p = f"blocks_token_only.{j}."
        shapes += [(p + "gamma_1", (d,)), (p + "gamma_2", (d,)), *norm(p + "norm1"),
                   *linear(p + "attn.q", d, d), *linear(p + "attn.k", d, d), *linear(p + "attn.v", d, d),
                   *linear(p + "attn.proj", d, d), *norm(p + "norm2"),
                   *linear(p + "mlp.fc1", 4 * d, d), *linear(p + "mlp.fc2", d, 4 * d)]
    return shapes + [*norm("norm"), *linear("head", CLASSES, d)]


def nbytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """Float32 bytes of all tensors."""
    total = 0
    for _, shape in shapes:
        n = 4
        for s in shape:
            n *= s
        total += n
    return total


def build_checkpoint(path: Path, size_gb: float, seed: int = 0) -> int:
    """Write a seeded official-layout CaiT checkpoint of about ``size_gb`` GB (1e9 bytes).

    Returns:
        The number of blocks used (48 at the default size).
    """
    import torch

    base, per_block = nbytes(cait_shapes(0)), nbytes(cait_shapes(1)) - nbytes(cait_shapes(0))
    depth = max(1, round((size_gb * 1e9 - base) / per_block))
    g = torch.Generator().manual_seed(seed)
    model = {}
    for name, shape in cait_shapes(depth):
        model["module." + name] = torch.empty(shape).normal_(std=0.02, generator=g)
    torch.save({"model": model}, path)
    return depth


def page_in(path: Path) -> None:
    """Read ``path`` so that it sits in the page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, float | None]:
    """Run ``argv``; return its wall time (s), peak RSS (MiB) and reported ``work_s`` (s) if any."""
    time_bin = shutil.which("time", path="/usr/bin")
    with tempfile.TemporaryFile("w+") as stdout, tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        if time_bin:
            subprocess.run([time_bin, "-v", "-o", report.name, *argv], env=env, stdout=stdout, check=True)
            wall = time.perf_counter() - start
            line = next(x for x in report.read().splitlines() if "Maximum resident set size" in x)
            peak = int(line.split(":")[-1]) / 1024
        else:
            process = subprocess.Popen(argv, env=env, stdout=stdout)
            _, status, usage = os.wait4(process.pid, 0)
            wall = time.perf_counter() - start
            if os.waitstatus_to_exitcode(status) != 0:
                raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), argv)
            peak = usage.ru_maxrss / 1024
        stdout.seek(0)
        work = [float(x.split("=", 1)[1]) for x in stdout.read().splitlines() if x.startswith("work_s=")]
    return wall, peak, work[-1] if work else None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def report(cmds: list[Command], walls: dict[str, list[float]], rss: dict[str, list[float]],
           works: dict[str, list[float]], size: int, repeats: int) -> None:
    """Print the markdown table and whether the streaming converter meets its targets."""
    wall = {k: statistics.median(v) for k, v in walls.items()}
    work = {k: statistics.median(v) for k, v in works.items() if v}
    peak = {k: max(v) for k, v in rss.items()}
    cp = wall["cp"]
    print(f"\n{size / 1e9:.2f} GB checkpoint; median of {repeats} runs (wall, work), highest peak RSS\n")
    print("| command | wall s | wall / cp | wall beyond start-up / cp | work s | work / cp "
          "| peak RSS MiB | RSS above start-up MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in cmds:
        beyond = f"{(wall[c.label] - wall[c.startup]) / cp:.2f}" if c.startup else ""
        worked = f"{work[c.label]:.2f} | {work[c.label] / cp:.2f}" if c.label in work else " | "
        above = f"{peak[c.label] - peak[c.startup]:.0f}" if c.startup else ""
        print(f"| {c.label} | {wall[c.label]:.2f} | {wall[c.label] / cp:.2f} | {beyond} | {worked} "
              f"| {peak[c.label]:.0f} | {above} |")
    for prefix in ("stream", "converter", "CLI"):
        c = next(c for c in cmds if c.label.startswith(prefix))
        beyond = work.get(c.label, wall[c.label] - wall[c.startup])
        print(f"\ntargets for '{c.label}': time beyond start-up <= 1.5x cp: "
              f"{'met' if beyond <= 1.5 * cp else 'MISSED'} ({beyond / cp:.2f}x); peak RSS <= start-up + 256 MiB: "
              f"{'met' if peak[c.label] - peak[c.startup] <= 256 else 'MISSED'} ({peak[c.label] - peak[c.startup]:.0f} MiB)")
    print("\nthe converter without verification reads the source once: hashing, the NaN/Inf check and the copy "
          "share one pass (conversion.stream); bench_convert.py compares it with import torch and cp.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.43, help="checkpoint size in GB (default 1.43, cait_m48_448)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per command; the median is reported")
    parser.add_argument("--workdir", type=Path, help="folder for the big files (default: a new temporary folder)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="bench_convert_io-", dir=args.workdir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    src, out = workdir / "cait_m48_448_official.pth", workdir / "out"
    cmds = commands(sys.executable)
    walls: dict[str, list[float]] = {c.label: [] for c in cmds}
    rss: dict[str, list[float]] = {c.label: [] for c in cmds}
    works: dict[str, list[float]] = {c.label: [] for c in cmds}
    digests: dict[str, str] = {}
    try:
        t0 = time.perf_counter()
        depth = build_checkpoint(src, args.size_gb)
        size = src.stat().st_size
        print(f"built {src.name}: {size / 1e9:.2f} GB, depth {depth}, in {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.repeats):
            for c in cmds:
                out.unlink(missing_ok=True)
                page_in(src)
                os.sync()
                wall, peak, work = run_once([a.replace("{src}", str(src)).replace("{out}", str(out)) for a in c.argv], env)
                os.sync()
                walls[c.label].append(wall)
                rss[c.label].append(peak)
                if work is not None:
                    works[c.label].append(work)
                if out.exists() and c.label != "cp":
                    digests[c.label] = sha256(out)
        out.unlink(missing_ok=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    report(cmds, walls, rss, works, size, args.repeats)
    # The writers store {"format": "pt"}; the converter adds its provenance: two groups of equal files.
    for group in (("naive", "stream"), ("converter", "CLI")):
        found = {label: d for label, d in digests.items() if label.startswith(group)}
        if len(set(found.values())) > 1:
            print(f"\nwarning: the outputs of {' and '.join(group)} differ:", found)
        elif found:
            print(f"\nthe outputs of {' and '.join(group)} are identical (sha256 {next(iter(found.values()))[:16]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
