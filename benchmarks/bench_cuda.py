"""CUDA inference of the LayerScale CaiT models against timm's ``cait_*``: time and parity.

For each model and precision (fp32; bf16 under ``torch.autocast``), timm's model and this
package's default (``attn_impl="reference"``) hold the same seeded weights and run in
turn on the same batch: eval, ``torch.inference_mode()``, timm's fused attention as
configured. Each round times ``ITERS`` forward passes of each model (CUDA synchronised
before and after); the ratio is the median of the per-round ratios. The table also says
whether the outputs are ``torch.equal``. Without a CUDA device the script says so and
writes nothing.

Usage::

    python benchmarks/bench_cuda.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_inference import seeded_models  # noqa: E402
from benchmarks.common import record  # noqa: E402

CASES = (("cait_xxs24_224", 64), ("cait_s24_224", 64))
ITERS = 10


def timed(model, x, autocast) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode(), autocast():
        for _ in range(ITERS):
            model(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / ITERS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    args = parser.parse_args(argv)
    import contextlib
    import functools

    import torch

    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; nothing measured", file=sys.stderr)
        return 0
    rounds = 3 if args.quick else 9
    precisions = {
        "fp32": contextlib.nullcontext,
        "bf16 autocast": functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16),
    }
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; {rounds} rounds of {ITERS} passes per model, eval, inference_mode",
        "",
        "| model | batch | precision | timm (ms) | default (ms) | default / timm | outputs torch.equal |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for name, batch in CASES:
        built = seeded_models(name, {"default": None})
        ref, ls = built["timm"].cuda(), built["default"].cuda()
        order = [("timm", ref), ("default", ls)]
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1)).cuda()
        for precision, autocast in precisions.items():
            with torch.inference_mode(), autocast():
                equal = torch.equal(ref(x), ls(x))
            for _ in range(2):  # warm-up
                for _, model in order:
                    timed(model, x, autocast)
            times: dict[str, list[float]] = {"timm": [], "default": []}
            for r in range(rounds):
                for label, model in order if r % 2 == 0 else order[::-1]:
                    times[label].append(timed(model, x, autocast))
            ratio = statistics.median(d / t for d, t in zip(times["default"], times["timm"], strict=True))
            t_ms, d_ms = (statistics.median(times[k]) * 1e3 for k in ("timm", "default"))
            lines.append(
                f"| {name}_ls | {batch} | {precision} | {t_ms:.2f} | {d_ms:.2f} | {ratio:.3f}x | {'yes' if equal else 'NO'} |"
            )
        del built, order, ref, ls
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(record(__file__, main))
