"""``model.flop_count()`` of every registered model against ``torch.utils.flop_counter``.

``flop_count`` counts multiplications (a multiply-add is 1); ``FlopCounterMode`` counts
a multiply-add as 2 and sees only matrix products (convolutions, linear layers,
attention), so the table compares ``flop_count`` with half its total. The small
remainder is what ``flop_count`` adds on top: LayerScale's per-channel multiplies.
Models are built and run on the ``meta`` device (shapes only), batch 1, at each
model's default input size; the target is agreement within 1%.

Usage::

    python benchmarks/bench_flops.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = 0.01


def registered_models() -> list[str]:
    """Every model name this package registers with timm."""
    import timm
    from timm.models import model_entrypoint

    import timm_layerscale  # noqa: F401  (registers the models)

    return sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("timm_layerscale."))


def counted_multiplies(model: torch.nn.Module, input_size: tuple) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, *input_size, device="meta"))
    return counter.get_total_flops() / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="accepted for the runner; the run is quick anyway")
    parser.parse_args(argv)
    import timm  # after the arguments: --help needs no torch

    lines = [
        "| model | input | flop_count (G mult) | FlopCounterMode / 2 (G) | difference | within 1% |",
        "|---|---|---:|---:|---:|---|",
    ]
    failures = 0
    for name in registered_models():
        model = timm.create_model(name, device="meta").eval()
        size = tuple(model.pretrained_cfg["input_size"])
        if not callable(getattr(model, "flop_count", None)):
            lines.append(f"| {name} | {size[1]}x{size[2]} | no `flop_count` | | | NO |")
            failures += 1
            continue
        ours, counted = model.flop_count(batch_size=1), counted_multiplies(model, size)
        diff = ours / counted - 1
        ok = abs(diff) <= TOLERANCE
        failures += not ok
        lines.append(
            f"| {name} | {size[1]}x{size[2]} | {ours / 1e9:.3f} | {counted / 1e9:.3f} | {diff * 100:+.3f}% "
            f"| {'yes' if ok else 'NO'} |"
        )
    lines += ["", f"{len(lines) - 2 - failures} of {len(lines) - 2} models within {TOLERANCE:.0%}."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from benchmarks.common import record

    sys.exit(record(__file__, main))
