"""Time and measure ``timm-layerscale convert --no-verify`` on a 1.43 GB checkpoint.

Builds a seeded checkpoint in the official CaiT layout (``{'model': {'module.' + key:
tensor}}``, every tensor of ``cait_m48_448``, about 1.43 GB), then runs each command
``--repeats`` times in turn, each in a fresh process from the same state (source in the
page cache, dirty pages flushed):

- ``python -c "import torch"``: the start-up the converter cannot avoid;
- ``cp SOURCE OUT``: reading and writing the bytes once;
- ``timm-layerscale convert SOURCE OUT.safetensors --no-verify``;
- ``torch.load`` + ``safetensors.torch.save_file``: what a conversion costs without streaming.

Targets for the conversion, medians compared: wall time at most ``import torch`` + 6x ``cp`` and
below ``torch.load`` + ``save_file``'s; peak anonymous memory (``RssAnon``: a mapped source's pages
are the page cache's) at most ``import torch``'s + 256 MiB (timm is imported: detection builds the registered
model on the meta device). The tensors of its
output are also compared byte for byte with ``save_file``'s, once (their order in the file differs).
The tables go to stdout and, as this script's section, into ``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/bench_convert.py [--repeats 5] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_model, record, repo_env, run_each

EMBED, HEADS, PATCHES, CLASS_BLOCKS, CLASSES, DEPTH = 768, 16, 784, 2, 1000, 48

NAIVE = """
import sys, torch
from safetensors.torch import save_file
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
save_file({k.removeprefix("module."): v for k, v in ckpt["model"].items()}, sys.argv[2], {"format": "pt"})
"""


def cait_shapes(depth: int) -> list[tuple[str, tuple[int, ...]]]:
    """Official CaiT keys and shapes (without the ``module.`` prefix) of ``cait_m48_448`` with ``depth`` blocks."""
    d, h = EMBED, HEADS

    def linear(name: str, n_out: int, n_in: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (n_out, n_in)), (f"{name}.bias", (n_out,))]

    def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (d,)), (f"{name}.bias", (d,))]

    shapes = [("cls_token", (1, 1, d)), ("pos_embed", (1, PATCHES, d))]
    shapes += [("patch_embed.proj.weight", (d, 3, 16, 16)), ("patch_embed.proj.bias", (d,))]
    for i in range(depth):
        p = f"blocks.{i}."
        shapes += [(p + "gamma_1", (d,)), (p + "gamma_2", (d,)), *norm(p + "norm1"),
                   *linear(p + "attn.qkv", 3 * d, d), *linear(p + "attn.proj", d, d),
                   *linear(p + "attn.proj_l", h, h), *linear(p + "attn.proj_w", h, h), *norm(p + "norm2"),
                   *linear(p + "mlp.fc1", 4 * d, d), *linear(p + "mlp.fc2", d, 4 * d)]  # fmt: skip
    for j in range(CLASS_BLOCKS):
        p = f"blocks_token_only.{j}."
        shapes += [(p + "gamma_1", (d,)), (p + "gamma_2", (d,)), *norm(p + "norm1"),
                   *linear(p + "attn.q", d, d), *linear(p + "attn.k", d, d), *linear(p + "attn.v", d, d),
                   *linear(p + "attn.proj", d, d), *norm(p + "norm2"),
                   *linear(p + "mlp.fc1", 4 * d, d), *linear(p + "mlp.fc2", d, 4 * d)]  # fmt: skip
    return shapes + [*norm("norm"), *linear("head", CLASSES, d)]


def build_checkpoint(path: Path, depth: int = DEPTH, seed: int = 0) -> None:
    """Write a seeded official-layout CaiT checkpoint (``depth`` 48: about 1.43 GB)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model = {"module." + k: torch.empty(s).normal_(std=0.02, generator=g) for k, s in cait_shapes(depth)}
    torch.save({"model": model}, path)


def page_in(path: Path) -> None:
    """Read ``path`` so that it sits in the page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def same_tensors(out: Path, naive: Path) -> bool:
    """Whether the conversion holds the tensors of the naive file (``gamma_N`` named ``lsN.gamma``),
    byte for byte, wherever their data lies."""
    import torch
    from safetensors import safe_open

    from timm_layerscale.conversion.rules import to_layerscale

    with safe_open(out, "pt") as fa, safe_open(naive, "pt") as fb:
        naive_names = fb.keys()
        names = to_layerscale(dict(zip(naive_names, naive_names, strict=True)), "cait")  # converted -> naive
        if set(names) != set(fa.keys()):
            return False
        for k, old in names.items():
            x, y = fa.get_tensor(k), fb.get_tensor(old)
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command; medians are compared")
    parser.add_argument("--quick", action="store_true", help="2 runs of each")
    parser.add_argument("--workdir", type=Path, help="folder for the big files (default: a new temporary folder)")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    env = repo_env()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir))
    src, out, naive = work / "M48_448.pth", work / "out.safetensors", work / "naive.safetensors"
    python = sys.executable
    commands = {
        '`python -c "import torch"`': [python, "-c", "import torch"],
        "`cp SOURCE OUT`": ["cp", str(src), str(out)],
        "`timm-layerscale convert SOURCE OUT.safetensors --no-verify`": [
            *(python, "-m", "timm_layerscale", "convert", str(src), str(out), "--no-verify", "--overwrite")
        ],
        "`torch.load` + `safetensors.torch.save_file`": [python, "-c", NAIVE, str(src), str(naive)],
    }
    torch_, cp, convert, load_save = commands

    def prepare() -> None:  # each run from the same state: no outputs, the source in the page cache
        out.unlink(missing_ok=True)
        naive.unlink(missing_ok=True)
        page_in(src)

    try:
        build_checkpoint(src)
        size = src.stat().st_size
        wall, rss = run_each(commands, repeats, env, prepare)
        subprocess.run(commands[convert], env=env, check=True, capture_output=True)
        same_data = same_tensors(out, naive)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = {k: statistics.median(v) for k, v in wall.items()}
    r = {k: statistics.median(v) for k, v in rss.items()}
    wall_limit, rss_limit = w[torch_] + 6 * w[cp], r[torch_] + 256
    met = [w[convert] <= wall_limit, w[convert] < w[load_save], r[convert] <= rss_limit, same_data]
    lines = [
        f"{size / 1e9:.2f} GB official-layout checkpoint; CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"median of {repeats} runs of each",
        "",
        "| command | wall s (median) | wall s (each run) | peak RssAnon MiB (median) |",
        "|---|---:|---|---:|",
        *(f"| {k} | {w[k]:.2f} | {' '.join(f'{x:.2f}' for x in wall[k])} | {r[k]:.0f} |" for k in commands),
        "",
        "| target | measured | limit | met |",
        "|---|---:|---:|---|",
        f"| wall <= import torch + 6x cp | {w[convert]:.2f} s | {wall_limit:.2f} s | {'yes' if met[0] else 'NO'} |",
        f"| wall < torch.load + save_file | {w[convert]:.2f} s | {w[load_save]:.2f} s | {'yes' if met[1] else 'NO'} |",
        f"| peak RssAnon <= import torch + 256 MiB | {r[convert]:.0f} MiB | {rss_limit:.0f} MiB "
        f"| {'yes' if met[2] else 'NO'} |",
        f"| tensors byte-identical to `save_file`'s | {'identical' if met[3] else 'differs'} | "
        f"| {'yes' if met[3] else 'NO'} |",
        "",
        f"time beyond `import torch`: {w[convert] - w[torch_]:.2f} s = {(w[convert] - w[torch_]) / w[cp]:.2f}x cp; "
        f"anonymous memory beyond `import torch`: {r[convert] - r[torch_]:.0f} MiB "
        f"(`torch.load` + `save_file`: {r[load_save] - r[torch_]:.0f} MiB).",
    ]
    print("\n".join(lines))
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(record(__file__, main))
