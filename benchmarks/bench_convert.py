"""Time and measure ``timm-layerscale convert --no-verify`` on a 1.43 GB checkpoint and a small one.

Builds a seeded checkpoint in the official CaiT layout (``{'model': {'module.' + key:
tensor}}``, every tensor of ``cait_m48_448``, about 1.43 GB) and the real-size ``cait_xxs24_224``
one the demo writes, then runs each command ``--repeats`` times in turn, each in a fresh process
from the same state (sources in the page cache, dirty pages flushed):

- ``python -c "import torch"``: the start-up the converter cannot avoid;
- ``cp SOURCE OUT``: reading and writing the bytes once;
- SHA-256 of the source with Python's ``hashlib`` (the converter records it);
- ``timm-layerscale convert SOURCE OUT.safetensors --no-verify``, of each file;
- ``torch.load`` + ``safetensors.torch.save_file``: what a conversion costs without streaming.

Targets, medians compared: the M48 conversion's wall time at most ``torch.load`` + ``save_file``'s and
at most ``import torch`` + SHA-256 + 2x ``cp``; the small one's at most ``import torch`` + 1 s; peak
anonymous memory (``RssAnon``: a mapped source's pages are the page cache's) at most ``import
torch``'s + 256 MiB. The tensors of the M48 output are compared byte for byte with ``save_file``'s,
once (their order in the file differs), and one more conversion of each prints its phases
(``--json``) and whether it imported timm. The first conversion, in a fresh shape table, is timed
apart (the cold start). The tables go to stdout and, as this script's section,
into ``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/bench_convert.py [--repeats 5] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_model, record, repo_env, run_each, run_once

EMBED, HEADS, PATCHES, CLASS_BLOCKS, CLASSES, DEPTH = 768, 16, 784, 2, 1000, 48

SHA256 = """
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    while block := f.read(1 << 20):
        h.update(block)
"""
#: A conversion's ``--json`` phases, and whether it imported timm (a ``--no-verify`` conversion need not).
PHASES = """
import json, sys
from timm_layerscale.cli import main
code = main(["convert", *sys.argv[1:], "--no-verify", "--overwrite", "--json", "-q"])
print(json.dumps({"code": code, "timm": "timm" in sys.modules}))
"""

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
    small, small_out = work / "XXS24_224.pth", work / "xxs24.safetensors"
    python = sys.executable
    converter = (python, "-m", "timm_layerscale", "convert")
    commands = {
        '`python -c "import torch"`': [python, "-c", "import torch"],
        "`cp SOURCE OUT`": ["cp", str(src), str(out)],
        "SHA-256 of SOURCE (`hashlib`)": [python, "-c", SHA256, str(src)],
        "`timm-layerscale convert SOURCE OUT.safetensors --no-verify`": [
            *converter,
            str(src),
            str(out),
            "--no-verify",
            "--overwrite",
        ],
        "the same conversion of `cait_xxs24_224` (0.05 GB)": [
            *converter,
            str(small),
            str(small_out),
            "--no-verify",
            "--overwrite",
        ],
        # last: its output stays for the comparison below
        "`torch.load` + `safetensors.torch.save_file`": [python, "-c", NAIVE, str(src), str(naive)],
    }
    torch_, cp, sha, convert, convert_small, load_save = commands

    def prepare() -> None:  # each run from the same state: no outputs, the sources in the page cache
        for path in (out, naive, small_out):
            path.unlink(missing_ok=True)
        page_in(src)
        page_in(small)

    try:
        from timm_layerscale.demo import write_official_checkpoint

        build_checkpoint(src)
        write_official_checkpoint(small, "cait_xxs24_224", seed=0)
        size = src.stat().st_size
        env["TIMM_LAYERSCALE_CACHE"] = str(work / "cache")  # a fresh shape table: the first conversion fills it
        prepare()
        cold = run_once(commands[convert_small], env)[0]
        wall, rss = run_each(commands, repeats, env, prepare)
        subprocess.run(commands[convert], env=env, check=True, capture_output=True)
        same_data = same_tensors(out, naive)
        phases = {}
        for name, (a, b) in {"M48": (src, out), "xxs24": (small, small_out)}.items():
            done = subprocess.run([python, "-c", PHASES, str(a), str(b)], env=env, check=True, capture_output=True)
            lines = done.stdout.decode().strip().splitlines()
            phases[name] = {**json.loads("\n".join(lines[:-1]))["phases"], **json.loads(lines[-1])}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = {k: statistics.median(v) for k, v in wall.items()}
    r = {k: statistics.median(v) for k, v in rss.items()}
    wall_limit, small_limit, rss_limit = w[torch_] + w[sha] + 2 * w[cp], w[torch_] + 1.0, r[torch_] + 256
    met = [w[convert] <= wall_limit, w[convert] <= w[load_save], r[convert] <= rss_limit, same_data]
    met.append(w[convert_small] <= small_limit)
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
        f"| wall <= import torch + SHA-256 + 2x cp | {w[convert]:.2f} s | {wall_limit:.2f} s "
        f"| {'yes' if met[0] else 'NO'} |",
        f"| wall <= torch.load + save_file | {w[convert]:.2f} s | {w[load_save]:.2f} s | {'yes' if met[1] else 'NO'} |",
        f"| `cait_xxs24_224` wall <= import torch + 1 s | {w[convert_small]:.2f} s | {small_limit:.2f} s "
        f"| {'yes' if met[4] else 'NO'} |",
        f"| peak RssAnon <= import torch + 256 MiB | {r[convert]:.0f} MiB | {rss_limit:.0f} MiB "
        f"| {'yes' if met[2] else 'NO'} |",
        f"| tensors byte-identical to `save_file`'s | {'identical' if met[3] else 'differs'} | "
        f"| {'yes' if met[3] else 'NO'} |",
        "",
        f"time beyond `import torch`: {w[convert] - w[torch_]:.2f} s = {(w[convert] - w[torch_]) / w[cp]:.2f}x cp; "
        f"anonymous memory beyond `import torch`: {r[convert] - r[torch_]:.0f} MiB "
        f"(`torch.load` + `save_file`: {r[load_save] - r[torch_]:.0f} MiB).",
        "",
        f"The first conversion, of `cait_xxs24_224` in a fresh shape table (timm builds its shapes once per "
        f"package, timm and torch version): {cold:.2f} s; the runs above read the table.",
        "",
        "Phases of one more conversion of each (`--json`, seconds):",
        "",
        "| file | " + " | ".join(k for k in phases["M48"] if k not in ("code", "timm")) + " | timm imported |",
        "|---|" + "---:|" * (len(phases["M48"]) - 2) + "---|",
        *(
            f"| {name} | "
            + " | ".join(f"{v:.2f}" for k, v in p.items() if k not in ("code", "timm"))
            + f" | {'yes' if p['timm'] else 'no'} |"
            for name, p in phases.items()
        ),
    ]
    print("\n".join(lines))
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(record(__file__, main))
