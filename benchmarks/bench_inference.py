"""CPU inference latency of LayerScale CaiT against timm's CaiT, per memory allocator.

Four models with the same random weights (every parameter, gammas of std 0.1):

* ``timm``: timm's ``cait_*``;
* ``default``: this package's ``cait_*_ls`` as ``create_model`` builds it
  (``attn_impl="reference"``, timm's formulation);
* ``buffered``: ``attn_impl="buffered"`` (opt-in), the same kernel calls with the large
  intermediates in reused buffers; its outputs, like the default's, are ``torch.equal``
  to timm's by construction (checked here too);
* ``fast``: ``attn_impl="fast"`` (opt-in; within its stated tolerance of timm's).

Everything runs in fp32, eval mode, ``torch.inference_mode()``, 2 threads. Each round
runs every model once, the order alternating; the tables give medians over the rounds
(after warm-up rounds) and the median of the per-round ratios, which cancels most drift
in machine load. The allocator is chosen at process start, so each one is measured in
its own process: glibc's default, glibc with large blocks kept
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``),
and jemalloc / tcmalloc through ``LD_PRELOAD`` where installed
(``apt-get install libjemalloc2 libtcmalloc-minimal4``).

The roofline is the time the model's multiplies (``flop_count``, two FLOPs each) take
at the GFLOP/s of a large fp32 ``torch.mm`` timed in the same rounds as the models.

Usage::

    python benchmarks/bench_inference.py [--quick] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_model, record  # noqa: E402

THREADS = 2
#: (timm model, batch)
CASES = (("cait_xxs24_224", 8), ("cait_s24_224", 4))
#: Targets: the default path no slower than timm with every allocator; the fast mode at most
#: 0.75x of timm's time with large blocks kept. The default makes timm's kernel calls, so its
#: ratio is 1 up to the noise between identical runs; 1% allows for that noise.
TARGET_DEFAULT, TUNED_FAST = 1.01, 0.75
#: The models beside timm's: label -> attn_impl (None: the default).
IMPLS = {"default": None, "buffered": "buffered", "fast": "fast"}
EXACT = ("default", "buffered")
GLIBC_TUNED = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"
PRELOADS = {
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
}


def allocators() -> dict[str, dict[str, str] | None]:
    """Allocator name -> environment additions (``None``: not installed here)."""
    out: dict[str, dict[str, str] | None] = {
        "glibc (default)": {},
        "glibc, large blocks kept": {"GLIBC_TUNABLES": GLIBC_TUNED},
    }
    for name, lib in PRELOADS.items():
        out[name] = {"LD_PRELOAD": lib} if Path(lib).exists() else None
    return out


# --- worker: one allocator, every case ------------------------------------------------


def _gemm() -> tuple[Any, float]:
    """A large fp32 GEMM to time beside the models, and its FLOPs."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out = torch.empty(2048, 2048)
    return (lambda _x: torch.mm(a, b, out=out)), 2 * 2048**3


def seeded_models(name: str, impls: dict[str, str | None] = IMPLS) -> dict:
    """timm's model (``"timm"``) with seeded weights, and the package's model per ``impls`` label on the same weights."""
    import timm
    import torch

    import timm_layerscale  # noqa: F401  (registers the models)
    from timm_layerscale import to_layerscale

    ref = timm.create_model(name).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "gamma" in key else 0.05))
    models = {"timm": ref}
    for label, impl in impls.items():
        m = timm.create_model(name + "_ls", **({"attn_impl": impl} if impl else {})).eval()
        m.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
        models[label] = m
    return models


def worker(runs: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    result: dict = {"cases": {}}
    gemm, gemm_flops = _gemm()
    for name, batch in CASES:
        models = seeded_models(name)
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            outs = {k: m(x) for k, m in models.items()}
        timed = dict(models, gemm=gemm)  # the GEMM runs in the same rounds, so the roofline sees the same load
        names = list(timed)
        times: dict[str, list[float]] = {k: [] for k in names}
        with torch.inference_mode():
            for _ in range(warmup):
                for k in names:
                    timed[k](x)
            for i in range(runs):
                for k in names if i % 2 == 0 else names[::-1]:
                    t0 = time.perf_counter()
                    timed[k](x)
                    times[k].append(time.perf_counter() - t0)
        result["cases"][f"{name} b{batch}"] = {
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "ratio": {
                k: statistics.median(a / b for a, b in zip(times[k], times["timm"], strict=True)) for k in models
            },
            "gemm_gflops": gemm_flops / statistics.median(times["gemm"]) / 1e9,
            "equal": {k: torch.equal(outs[k], outs["timm"]) for k in EXACT},
            "fast_max_abs_diff": (outs["fast"] - outs["timm"]).abs().max().item(),
            "multiplies": models["default"].flop_count(batch),
        }
        ratio = result["cases"][f"{name} b{batch}"]["ratio"]
        print(f"  {name} b{batch}: " + ", ".join(f"{k} {ratio[k]:.3f}x" for k in IMPLS), file=sys.stderr, flush=True)
    return result


# --- parent: one process per allocator, then the tables --------------------------------


def run_allocator(env_add: dict[str, str], runs: int, warmup: int) -> dict:
    env = dict(os.environ, **env_add)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--runs", str(runs), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tables(results: dict[str, dict | None], runs: int) -> list[str]:
    out = [
        f"CPU: {cpu_model()}; {THREADS} threads; torch {_torch_version()}; medians of {runs} interleaved rounds.",
        "",
        "#### Latency by allocator (fp32, eval, inference_mode)",
        "",
        "| model | allocator | timm ms | default ms | default / timm | buffered ms | buffered / timm | fast ms | fast / timm | default, buffered `torch.equal` timm | fast max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for case in [f"{n} b{b}" for n, b in CASES]:
        for alloc, res in results.items():
            if res is None:
                out.append(f"| {case} | {alloc} | not installed | | | | | | | | |")
                continue
            c = res["cases"][case]
            cols = "".join(f" {c['ms'][k]:.1f} | {c['ratio'][k]:.3f}x |" for k in IMPLS)
            equal = ", ".join("yes" if c["equal"][k] else "NO" for k in EXACT)
            out.append(f"| {case} | {alloc} | {c['ms']['timm']:.1f} |{cols} {equal} | {c['fast_max_abs_diff']:.2g} |")
    out += ["", "#### Targets", "", "| model | check | measured | target | met |", "|---|---|---:|---:|---|"]
    tuned = results["glibc, large blocks kept"]
    for name, batch in CASES:
        case = f"{name} b{batch}"
        rows = [
            (f"default / timm, {alloc}", res["cases"][case]["ratio"]["default"], TARGET_DEFAULT)
            for alloc, res in results.items()
            if res is not None
        ]
        rows += [
            ("fast / timm, glibc large blocks kept", tuned["cases"][case]["ratio"]["fast"], TUNED_FAST),
            (
                "default and buffered outputs `torch.equal` timm (every allocator)",
                float(all(all(r["cases"][case]["equal"].values()) for r in results.values() if r)),
                1.0,
            ),
        ]
        for label, value, goal in rows:
            equality = "outputs" in label
            met = value == goal if equality else value <= goal
            shown = ("yes" if value == 1.0 else "no") if equality else f"{value:.3f}x"
            want = "yes" if equality else f"<= {goal:.2f}x"
            out.append(f"| {case} | {label} | {shown} | {want} | {'yes' if met else 'NO'} |")
    out += [
        "",
        "#### Fraction of the fp32 GEMM roofline",
        "",
        "Roofline: 2 x `flop_count(batch)` FLOPs at the GFLOP/s of a 2048x2048 fp32 `torch.mm` timed in the same rounds.",
        "",
        "| model | allocator | GEMM GFLOP/s | roofline ms | timm | default | buffered | fast |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in [f"{n} b{b}" for n, b in CASES]:
        for alloc, res in results.items():
            if res is None:
                continue
            c = res["cases"][case]
            roof = 2 * c["multiplies"] / (c["gemm_gflops"] * 1e9) * 1e3
            fracs = " | ".join(f"{roof / c['ms'][k]:.0%}" for k in ("timm", *IMPLS))
            out.append(f"| {case} | {alloc} | {c['gemm_gflops']:.0f} | {roof:.0f} | {fracs} |")
    return out


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    p.add_argument("--runs", type=int, help="timed rounds per allocator (default 9, 3 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    runs = a.runs or (3 if a.quick else 9)
    if a.worker:
        print(json.dumps(worker(runs, a.warmup)))
        return 0
    results: dict[str, dict | None] = {}
    for name, env_add in allocators().items():
        print(f"allocator: {name}", file=sys.stderr, flush=True)
        results[name] = None if env_add is None else run_allocator(env_add, runs, a.warmup)
    print("### Inference latency: timm, the default path, the buffered and fast modes\n")
    print("\n".join(tables(results, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) if "--worker" in sys.argv else record(__file__, main))
