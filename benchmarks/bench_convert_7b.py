"""Peak memory of ``timm-layerscale convert --no-verify`` on the DINOv3 7B: constant in the model's size.

Writes seeded bf16 checkpoints in the official DINOv3 layout (``storage_tokens``, fused ``qkv.bias`` with its mask
but for the 7B, SwiGLU ``w1``/``w2``/``w3``, ``rope_embed.periods``, the 7B's ``local_cls_norm``) one tensor at a
time: ``vit_huge_plus_patch16_dinov3`` (about 1.7 GB) and ``vit_7b_patch16_dinov3`` (about 13.4 GB). Then, for
each, runs ``python -c "import torch"`` and the conversion to the module layout ``--repeats`` times in turn, each in
a fresh process, and measures wall time and peak anonymous memory (``RssAnon``: a mapped source's pages are the
page cache's), and prints one more run's phases (``--json``). Target: the conversion's peak at most ``import
torch``'s + 256 MiB for both sizes. Last, the 7B converted with verification: where the machine has less memory
than its two fp32 models need, one line and exit 2 before anything is built. ``--quick`` measures the huge model
only, once.

Usage::

    python benchmarks/bench_convert_7b.py [--repeats 3] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record, repo_env, run_each

MODELS = ("vit_huge_plus_patch16_dinov3_ls", "vit_7b_patch16_dinov3_ls")


def official_tensors(name: str) -> dict[str, Any]:
    """The official file of a registered DINOv3 variant (a backbone: no classifier) as the conversion writes it: its
    learned tensors on the meta device, the buffers its consumer stores (rotary periods, bias masks) with values."""
    import torch

    from timm_layerscale.conversion.rules import target_tensors
    from timm_layerscale.families import get_variant, state_dict_shapes

    v = get_variant(name)
    meta = {k: torch.empty(s, device="meta") for k, s in state_dict_shapes(v, 0).items()}
    return target_tensors(meta, v, v.family.layouts["ls"], v.family.layouts["official"])


def write_official(path: Path, name: str, seed: int = 0) -> None:
    """A seeded bf16 official-layout safetensors file of ``name``, written one tensor at a time (the buffers as
    computed, every other tensor random)."""
    import torch

    tensors = official_tensors(name)
    header, offset = {}, 0
    for key, t in tensors.items():
        size = 2 * int(t.numel())
        header[key] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for t in tensors.values():
            values = torch.empty(t.shape, dtype=torch.bfloat16).normal_(std=0.02, generator=g) if t.is_meta else t
            f.write(values.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().data)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per command; medians are compared")
    parser.add_argument("--quick", action="store_true", help="the huge model only, one run")
    parser.add_argument("--workdir", type=Path, help="folder for the big files (default: a new temporary folder)")
    args = parser.parse_args(argv)
    repeats, models = (1, MODELS[:1]) if args.quick else (args.repeats, MODELS)
    env = repo_env()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_7b-", dir=args.workdir))
    python, rows, met, refusal, phases = sys.executable, [], [], "", {}
    try:
        for name in models:
            src, out = work / f"{name}.safetensors", work / "out.safetensors"
            write_official(src, name)
            commands = {
                '`python -c "import torch"`': [python, "-c", "import torch"],
                "`convert SOURCE OUT --no-verify`": [
                    *(python, "-m", "timm_layerscale", "convert", str(src), str(out), "--no-verify", "--overwrite")
                ],
            }
            wall, rss = run_each(commands, repeats, env, partial(out.unlink, missing_ok=True))
            w = {c: statistics.median(v) for c, v in wall.items()}
            r = {c: statistics.median(v) for c, v in rss.items()}
            torch_, convert = commands
            met.append(r[convert] <= r[torch_] + 256)
            size = src.stat().st_size / 1e9
            rows += [f"| {name} | {size:.1f} | {c} | {w[c]:.1f} | {r[c]:.0f} |" for c in commands]
            once = subprocess.run([*commands[convert], "--json", "-q"], env=env, capture_output=True, check=True)
            phases[name] = json.loads(once.stdout)["phases"]  # one more run's, for where the time goes
            if "7b" in name:
                out.unlink(missing_ok=True)
                done = subprocess.run(
                    [python, "-m", "timm_layerscale", "convert", str(src), str(out)], env=env, capture_output=True,
                    text=True,
                )  # fmt: skip
                refusal = f"exit {done.returncode}: `{done.stderr.strip()}`"
                met.append(done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and not out.exists())
            src.unlink()
            out.unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"bf16 official-layout DINOv3 checkpoints; median of {repeats} run(s) of each",
        "",
        "| model | file GB | command | wall s (median) | peak RssAnon MiB (median) |",
        "|---|---:|---|---:|---:|",
        *rows,
        "",
        f"target: the conversion's peak RssAnon at most `import torch`'s + 256 MiB for every size: "
        f"{'met' if all(met[: len(models)]) else 'NOT met'}",
    ]
    names = list(next(iter(phases.values()), {}))
    lines += ["", "Phases of one more conversion of each (`--json`, seconds):", ""]
    lines += ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {m} | " + " | ".join(f"{p[k]:.2f}" for k in names) + " |" for m, p in phases.items()]
    if refusal:
        lines += ["", f"the 7B with verification, on this machine: {refusal}"]
    print("\n".join(lines))
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(record(__file__, main))
