"""Peak memory of ``timm-layerscale convert`` on the largest models: without verification, constant in the model's
size; with it, one block at a time.

Writes seeded checkpoints in the official layouts one tensor at a time: bf16 DINOv3 files (``storage_tokens``, fused
``qkv.bias`` with its mask but for the 7B, SwiGLU ``w1``/``w2``/``w3``, ``rope_embed.periods``, the 7B's
``local_cls_norm``) of ``vit_huge_plus_patch16_dinov3`` (about 1.7 GB) and ``vit_7b_patch16_dinov3`` (about 13.4
GB), and the official fp32 ``.pth`` of ``cait_m48_448`` (about 1.4 GB). Then, for each, runs ``python -c "import
torch"``, the conversion to the module layout without verification and with it on one seeded image (one block at a
time: as ``--stream`` asks for the two smaller ones, by the size rule for the 7B; the two smaller ones in memory too,
as the rule has them here, and streamed with a cast to fp16) ``--repeats`` times in turn, each
in a fresh process, and measures wall time and peak anonymous memory (``RssAnon``: a mapped source's pages are the
page cache's), and prints one more verified run's phases (``--json``). Targets: without verification at most
``import torch``'s + 256 MiB; verified one block at a time at most 3 GiB, the 7B at most 6 GiB. Last, the 7B with
default verification (8 images) once, its time. ``--quick`` measures the huge model only, once.

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
from benchmarks.common import record, repo_env, run_each, run_once

MODELS = ("vit_huge_plus_patch16_dinov3_ls", "cait_m48_448_ls", "vit_7b_patch16_dinov3_ls")
#: The peak RssAnon (MiB) a verification one block at a time may reach.
VERIFIED_MIB = {"vit_7b_patch16_dinov3_ls": 6 * 1024}


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


def write_source(path: Path, name: str) -> None:
    """The seeded official file of ``name``: DINOv3's one tensor at a time (:func:`write_official`), CaiT's as the
    authors' code saves it."""
    if "cait" in name:
        from timm_layerscale.demo import write_official_checkpoint

        write_official_checkpoint(path, name.removesuffix("_ls"))
    else:
        write_official(path, name)


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
    python, rows, met, phases, default = sys.executable, [], [], {}, ""
    try:
        for name in models:
            src, out = work / f"{name}.{'pth' if 'cait' in name else 'safetensors'}", work / "out.safetensors"
            write_source(src, name)
            convert = [python, "-m", "timm_layerscale", "convert", str(src), str(out), "--overwrite"]
            verified = [*convert, "--num-inputs", "1", *(() if "7b" in name else ("--stream",))]
            commands = {
                '`python -c "import torch"`': [python, "-c", "import torch"],
                "`convert SOURCE OUT --no-verify`": [*convert, "--no-verify"],
                f"`convert SOURCE OUT --num-inputs 1{'' if '7b' in name else ' --stream'}`": verified,
            }
            if "7b" not in name:  # in memory, as the size rule has it here: the path before; a cast, streamed
                commands["`convert SOURCE OUT --num-inputs 1`"] = verified[:-1]
                commands["`convert SOURCE OUT --num-inputs 1 --stream --dtype fp16`"] = [*verified, "--dtype", "fp16"]
            wall, rss = run_each(commands, repeats, env, partial(out.unlink, missing_ok=True))
            w = {c: statistics.median(v) for c, v in wall.items()}
            r = {c: statistics.median(v) for c, v in rss.items()}
            torch_, unverified, streamed = list(commands)[:3]
            cast = list(commands)[4:]
            met += [r[unverified] <= r[torch_] + 256]
            met += [r[c] <= VERIFIED_MIB.get(name, 3 * 1024) for c in (streamed, *cast)]
            size = src.stat().st_size / 1e9
            rows += [f"| {name} | {size:.1f} | {c} | {w[c]:.1f} | {r[c]:.0f} |" for c in commands]
            once = subprocess.run([*verified, "--json", "-q"], env=env, capture_output=True, check=True)
            result = json.loads(once.stdout)
            phases[name] = {**result["phases"], "weights held": result["report"]["path"]}
            if "7b" in name and not args.quick:  # the default verification: 8 seeded images
                out.unlink(missing_ok=True)
                seconds, peak = run_once([*convert, "-q"], env)
                default = f"{seconds:.0f} s, peak RssAnon {peak:.0f} MiB"
            src.unlink()
            out.unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"official-layout checkpoints, seeded; median of {repeats} run(s) of each",
        "",
        "| model | file GB | command | wall s (median) | peak RssAnon MiB (median) |",
        "|---|---:|---|---:|---:|",
        *rows,
        "",
        "targets: without verification, peak RssAnon at most `import torch`'s + 256 MiB; verified one block at a time, "
        f"at most 3 GiB (the 7B: 6 GiB): {'met' if all(met) else 'NOT met'}",
    ]
    names = list(next(iter(phases.values()), {}))
    lines += ["", "Phases of one more verified conversion of each (`--json`, seconds):", ""]
    lines += ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {m} | " + " | ".join(str(p.get(k, "")) for k in names) + " |" for m, p in phases.items()]
    if default:
        lines += ["", f"the 7B with default verification (8 seeded images), once: {default}"]
    print("\n".join(lines))
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(record(__file__, main))
