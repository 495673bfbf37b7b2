"""Inference speed and memory of LayerScale CaiT against timm's CaiT, on CPU.

Both models get the same random weights (every parameter, LayerScale gammas with std
0.1), so outputs can be compared with ``torch.equal``. Everything runs in fp32, eval
mode, under ``torch.inference_mode()``, on ``torch.set_num_threads(2)``. Latencies are
interleaved: each round runs every model once (the order alternates between rounds),
after warm-up rounds; the tables give the median time and the median of the per-round
ratios, which cancels most drift in machine load.

Sections:

1. Latency, ours vs timm, ``cait_xxs24_224`` at batch 8 and ``cait_s24_224`` at batch 4,
   against the targets (0.85x and 0.92x), with the bit-exactness check.
2. What each change in the attention buys: alternative formulations of the
   talking-heads attention, swapped into our model one at a time.
3. Peak memory of one forward pass: the rise of the resident-set high-water mark over
   the resident set before the pass, in a fresh process per model (malloc is told to
   give large blocks back to the system at once, so freed memory is not reused
   unseen; a warm-up pass runs first).
4. ``torch.compile`` (inductor, default mode): cold compile time of each model (its own
   fresh inductor cache), then interleaved latency of the compiled models.
5. LayerScale folded (``fuse_layerscale``) vs not, eager (and compiled in section 4).

Usage::

    python benchmarks/bench_inference.py [--quick] [--runs N] [--no-compile]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import timm  # noqa: E402
from torch import nn  # noqa: E402

import timm_layerscale  # noqa: E402,F401  (registers the models)
from timm_layerscale import fuse_layerscale, to_layerscale  # noqa: E402

THREADS = 2
#: (timm model, batch, target ratio of our latency to timm's)
CASES: Tuple[Tuple[str, int, float], ...] = (("cait_xxs24_224", 8, 0.85), ("cait_s24_224", 4, 0.92))
COMPILE_CASE = ("cait_xxs24_224", 8)


# --- models --------------------------------------------------------------------------


def build_pair(name: str, seed: int = 0) -> Tuple[nn.Module, nn.Module]:
    """timm's ``name`` and our ``name + '_ls'`` with the same random weights."""
    ref = timm.create_model(name, device="meta").to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "gamma" in key else 0.05))
    ours = timm.create_model(name + "_ls", device="meta")
    state = {k: v.clone() for k, v in to_layerscale(ref.state_dict(), "cait").items()}
    ours.load_state_dict(state, strict=True, assign=True)
    return ref.eval(), ours.eval()


def images(batch: int, size: int = 224) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


# --- alternative attention formulations (section 2) ----------------------------------
# Each takes the place of TalkingHeadAttn.forward on every self-attention block.


def _mix_alloc(attn: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    B, H, N, M = attn.shape
    out = torch.matmul(linear.weight, attn.reshape(B, H, N * M))
    out += linear.bias.view(H, 1)
    return out.view(B, H, N, M)


def attn_matmul_mix(self, x: torch.Tensor) -> torch.Tensor:
    """Heads mixed by one batched matmul on the (B, H, N, N) logits; fresh tensors throughout."""
    B, N, C = x.shape
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
    attn = _mix_alloc(q @ k.transpose(-2, -1), self.proj_l).softmax(dim=-1)
    attn = _mix_alloc(attn, self.proj_w)
    return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


def attn_matmul_mix_buffers(self, x: torch.Tensor) -> torch.Tensor:
    """As above, with the mixes and the softmax written into two reused buffers."""
    B, N, C = x.shape
    H = self.num_heads
    qkv = self.qkv(x).reshape(B, N, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
    attn = q @ k.transpose(-2, -1)
    buf = torch.empty_like(attn)
    torch.matmul(self.proj_l.weight, attn.view(B, H, N * N), out=buf.view(B, H, N * N))
    buf += self.proj_l.bias.view(H, 1, 1)
    torch.softmax(buf, dim=-1, out=attn)
    torch.matmul(self.proj_w.weight, attn.view(B, H, N * N), out=buf.view(B, H, N * N))
    buf += self.proj_w.bias.view(H, 1, 1)
    return self.proj((buf @ v).transpose(1, 2).reshape(B, N, C))


def _qkv_laid_out(self, x: torch.Tensor):
    B, N, C = x.shape
    H, d = self.num_heads, self.head_dim
    qkv = self.qkv(x).view(B, N, 3, H, d)
    q = torch.empty(B, H, N, d, dtype=qkv.dtype)
    torch.mul(qkv[:, :, 0].transpose(1, 2), self.scale, out=q)
    k_t = qkv[:, :, 1].permute(0, 2, 3, 1).contiguous()
    v = qkv[:, :, 2].transpose(1, 2).contiguous()
    logits = torch.empty(B, H, N, N, dtype=qkv.dtype)
    torch.bmm(q.view(B * H, N, d), k_t.view(B * H, d, N), out=logits.view(B * H, N, N))
    return q, v, logits


def _mix_gemm_bias(src: torch.Tensor, linear: nn.Linear, dst: torch.Tensor) -> None:
    B, H, N, M = src.shape
    torch.baddbmm(linear.bias.view(1, H, 1), linear.weight.expand(B, H, H), src.view(B, H, N * M),
                  out=dst.view(B, H, N * M))


def attn_gemm_bias(self, x: torch.Tensor) -> torch.Tensor:
    """The shipped layout, but the mix bias added inside the GEMM (``baddbmm``)."""
    B, N, C = x.shape
    H, d = self.num_heads, self.head_dim
    q, v, logits = _qkv_laid_out(self, x)
    mixed = torch.empty_like(logits)
    _mix_gemm_bias(logits, self.proj_l, mixed)
    torch.softmax(mixed, dim=-1, out=logits)
    _mix_gemm_bias(logits, self.proj_w, mixed)
    out = torch.bmm(mixed.view(B * H, N, N), v.view(B * H, N, d), out=q.view(B * H, N, d))
    return self.proj(out.view(B, H, N, d).transpose(1, 2).reshape(B, N, C))


def attn_out_per_image(self, x: torch.Tensor) -> torch.Tensor:
    """The shipped layout, but ``attn @ v`` written per image straight into (B, N, H, d)."""
    B, N, C = x.shape
    H, d = self.num_heads, self.head_dim
    q, v, logits = _qkv_laid_out(self, x)
    mixed = torch.empty_like(logits)
    self._mix_heads(logits, self.proj_l, out=mixed)
    torch.softmax(mixed, dim=-1, out=logits)
    self._mix_heads(logits, self.proj_w, out=mixed)
    out = torch.empty(B, N, H, d, dtype=x.dtype)
    v = v.view(B, H, N, d)
    for b in range(B):
        torch.bmm(mixed[b], v[b], out=out[b].transpose(0, 1))
    return self.proj(out.view(B, N, C))


#: label -> (forward replacement or None for the shipped one, fast_inference flag, note)
VARIANTS: Dict[str, Tuple[Optional[Callable], bool, str]] = {
    "reference formulation (`fast_inference=False`)": (None, False, "timm's math in our model"),
    "head mix as one batched matmul, fresh tensors": (attn_matmul_mix, True, "no permuted copies"),
    "+ two reused (B, H, N, N) buffers": (attn_matmul_mix_buffers, True, "fewer large allocations"),
    "+ q, k^T, v laid out once, bmm into the buffers (shipped)": (None, True, "default"),
    "shipped, mix bias inside the GEMM (`baddbmm`)": (attn_gemm_bias, True, "rejected: not bit-exact in bf16"),
    "shipped, `attn @ v` per image into (B, N, H, d)": (attn_out_per_image, True, "tried"),
}


def with_variant(model: nn.Module, forward: Optional[Callable], fast: bool) -> nn.Module:
    model = copy.deepcopy(model)
    for blk in model.blocks:
        blk.attn.fast_inference = fast
        if forward is not None:
            blk.attn.forward = types.MethodType(forward, blk.attn)
    return model


# --- timing --------------------------------------------------------------------------


def interleaved(models: Dict[str, Callable], x: torch.Tensor, runs: int, warmup: int = 2) -> Dict[str, List[float]]:
    """Per-round wall times (s) of each callable, rounds alternating the order."""
    names = list(models)
    times: Dict[str, List[float]] = {k: [] for k in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for k in names:
                models[k](x)
        for i in range(runs):
            for k in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                models[k](x)
                times[k].append(time.perf_counter() - t0)
    return times


def ratio(times: Dict[str, List[float]], num: str, den: str) -> float:
    """Median of the per-round ratios ``num / den``."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def ms(values: List[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}"


def spread(values: List[float]) -> str:
    qs = statistics.quantiles(values, n=4) if len(values) >= 4 else [min(values), 0, max(values)]
    return f"{qs[0] * 1e3:.0f}-{qs[-1] * 1e3:.0f}"


def equal(a: nn.Module, b: nn.Module, x: torch.Tensor) -> bool:
    with torch.inference_mode():
        return torch.equal(a(x), b(x))


# --- sections ------------------------------------------------------------------------


def section_latency(runs: int) -> List[str]:
    out = [
        "### 1. Eager latency, ours vs timm (fp32, eval, inference_mode, 2 threads)",
        "",
        f"Median of {runs} interleaved rounds after 2 warm-up rounds; IQR in brackets.",
        "",
        "| model | batch | timm ms | ours ms | ours / timm | target | met | outputs `torch.equal` |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, batch, target in CASES:
        ref, ours = build_pair(name)
        x = images(batch)
        same = equal(ref, ours, x)
        t = interleaved({"timm": ref, "ours": ours}, x, runs)
        r = ratio(t, "ours", "timm")
        out.append(
            f"| {name} | {batch} | {ms(t['timm'])} ({spread(t['timm'])}) | {ms(t['ours'])} ({spread(t['ours'])}) "
            f"| {r:.3f}x | <= {target:.2f}x | {'yes' if r <= target else f'NO (by {r - target:.3f})'} | {same} |"
        )
        print(f"  latency {name}: {r:.3f}x", file=sys.stderr, flush=True)
        del ref, ours
        gc.collect()
    return out


def section_ablation(runs: int, quick: bool) -> List[str]:
    out = [
        "### 2. What each attention change buys (eager, same settings)",
        "",
        "Each row swaps one formulation of the talking-heads attention into our model; all "
        "rows run interleaved with timm's model in the same rounds. `equal`: output "
        "`torch.equal` to timm's.",
        "",
    ]
    cases = CASES[:1] if quick else CASES
    for name, batch, _ in cases:
        ref, ours = build_pair(name)
        x = images(batch)
        models: Dict[str, Callable] = {"timm": ref}
        for label, (fwd, fast, _) in VARIANTS.items():
            models[label] = with_variant(ours, fwd, fast)
        same = {label: equal(ref, m, x) for label, m in models.items() if label != "timm"}
        t = interleaved(models, x, runs)
        out += [
            f"{name}, batch {batch}, {runs} rounds:",
            "",
            "| attention formulation | ms | / timm | equal | note |",
            "|---|---:|---:|---|---|",
            f"| timm `cait_*` | {ms(t['timm'])} | 1.000x | - | reference |",
        ]
        for label, (_, _, note) in VARIANTS.items():
            out.append(f"| {label} | {ms(t[label])} | {ratio(t, label, 'timm'):.3f}x | {same[label]} | {note} |")
        out.append("")
        print(f"  ablation {name} done", file=sys.stderr, flush=True)
        del ref, ours, models
        gc.collect()
    return out


_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": str(THREADS)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _forward_peak_mib(model: nn.Module, x: torch.Tensor) -> float:
    with torch.inference_mode():
        model(x)  # warm-up: one-time allocations (oneDNN primitives, MKL buffers)
        gc.collect()
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        y = model(x)
        peak = _status_kib("VmHWM")
    del y
    return (peak - before) / 1024


def child_memory(name: str, batch: int, rotate: int) -> Dict[str, float]:
    """Peak of one forward of timm's, ours and ours folded, in an order rotated by ``rotate``."""
    torch.set_num_threads(THREADS)
    ref, ours = build_pair(name)
    models = {"timm": ref, "ours": ours, "ours fused": fuse_layerscale(copy.deepcopy(ours))}
    x = images(batch)
    order = list(models)[rotate % 3:] + list(models)[: rotate % 3]
    return {k: _forward_peak_mib(models[k], x) for k in order}


def _run_child(args: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 1200) -> Dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0][:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_memory(reps: int) -> List[str]:
    out = [
        "### 3. Peak memory of one forward pass",
        "",
        "Rise of VmHWM over VmRSS during one forward, after a warm-up forward, the three models "
        f"measured one after the other in a fresh process (order rotated); median of {reps} processes. "
        "Weights and the interpreter are in the baseline, so this is the activations' peak.",
        "",
        "| model | batch | timm MiB | ours MiB | ours / timm | ours fused MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, batch, _ in CASES:
        got: Dict[str, List[float]] = {"timm": [], "ours": [], "ours fused": []}
        error = None
        for rep in range(reps):
            res = _run_child(["--_child-memory", name, str(batch), str(rep)], env=_MALLOC_ENV)
            if "error" in res:
                error = res["error"]
                break
            for k in got:
                got[k].append(res[k])
        if error:
            out.append(f"| {name} | {batch} | failed: {error} | | | |")
            continue
        med = {k: statistics.median(v) for k, v in got.items()}
        out.append(
            f"| {name} | {batch} | {med['timm']:.1f} | {med['ours']:.1f} | {med['ours'] / med['timm']:.2f}x "
            f"| {med['ours fused']:.1f} |"
        )
        print(f"  memory {name} done", file=sys.stderr, flush=True)
    return out


def _fresh_cache():
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache")
    return fresh()


def child_compile(name: str, batch: int, runs: int) -> Dict:
    torch.set_num_threads(THREADS)
    ref, ours = build_pair(name)
    fused = fuse_layerscale(copy.deepcopy(ours))
    x = images(batch)
    eager = {"timm": ref, "ours": ours, "ours fused": fused}
    compiled: Dict[str, Callable] = {}
    compile_s: Dict[str, float] = {}
    outputs = {}
    for label, model in eager.items():
        with _fresh_cache():
            c = torch.compile(model)
            t0 = time.perf_counter()
            with torch.inference_mode():
                outputs[label] = c(x)
            compile_s[label] = time.perf_counter() - t0
        compiled[label] = c
        print(f"  compiled {label} in {compile_s[label]:.0f} s", file=sys.stderr, flush=True)
    with torch.inference_mode():
        diffs = {k: (outputs[k] - eager["timm"](x)).abs().max().item() for k in outputs}
    timed: Dict[str, Callable] = {f"compiled {k}": v for k, v in compiled.items()}
    timed.update({"eager timm": ref, "eager ours": ours})
    t = interleaved(timed, x, runs)
    return {"compile_s": compile_s, "times": t, "diffs": diffs}


def section_compile(runs: int) -> List[str]:
    name, batch = COMPILE_CASE
    out = [
        "### 4. torch.compile (inductor, default mode)",
        "",
        f"{name}, batch {batch}. Compile time: wall time of the first call, each model with a fresh "
        f"inductor cache. Latency: {runs} interleaved rounds of the compiled and eager models in one "
        "process. Under compilation our attention takes the reference formulation (the in-place "
        "inference path cannot be traced; a functional batched-matmul head mix compiled to the same "
        "speed), so compiled ours and compiled timm run the same graph up to LayerScale. The whole "
        "model compiles to one graph, without graph breaks.",
        "",
    ]
    res = _run_child(["--_child-compile", name, str(batch), str(runs)], timeout=3000)
    if "error" in res:
        return out + [f"torch.compile failed on this machine: {res['error']}", ""]
    t, cs, diffs = res["times"], res["compile_s"], res["diffs"]
    out += [
        "| model | compile s | ms | / eager timm | / compiled timm | max abs diff vs eager timm |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in ("timm", "ours", "ours fused"):
        out.append(
            f"| compiled {label} | {cs[label]:.0f} | {ms(t['compiled ' + label])} "
            f"| {ratio(t, 'compiled ' + label, 'eager timm'):.3f}x | {ratio(t, 'compiled ' + label, 'compiled timm'):.3f}x "
            f"| {diffs[label]:.1e} |"
        )
    for label in ("timm", "ours"):
        out.append(
            f"| eager {label} | - | {ms(t['eager ' + label])} | {ratio(t, 'eager ' + label, 'eager timm'):.3f}x "
            f"| {ratio(t, 'eager ' + label, 'compiled timm'):.3f}x | - |"
        )
    return out + [""]


def section_fuse(runs: int, quick: bool) -> List[str]:
    out = [
        "### 5. LayerScale folded into `attn.proj` / `mlp.fc2` vs not (eager)",
        "",
        "| model | batch | unfused ms | fused ms | fused / unfused | max abs diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, batch, _ in CASES[:1] if quick else CASES:
        _, ours = build_pair(name)
        fused = fuse_layerscale(copy.deepcopy(ours))
        x = images(batch)
        with torch.inference_mode():
            diff = (fused(x) - ours(x)).abs().max().item()
        t = interleaved({"unfused": ours, "fused": fused}, x, runs)
        out.append(
            f"| {name}_ls | {batch} | {ms(t['unfused'])} | {ms(t['fused'])} | {ratio(t, 'fused', 'unfused'):.3f}x "
            f"| {diff:.1e} |"
        )
        del ours, fused
        gc.collect()
    return out + [""]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, first model only where optional")
    parser.add_argument("--runs", type=int, help="timed rounds per table (default 15, quick 5)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile section")
    parser.add_argument("--_child-memory", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--_child-compile", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child_memory:
        name, batch, rotate = args._child_memory
        print(json.dumps(child_memory(name, int(batch), int(rotate))))
        return 0
    if args._child_compile:
        name, batch, runs = args._child_compile
        print(json.dumps(child_compile(name, int(batch), int(runs))))
        return 0

    torch.set_num_threads(THREADS)
    runs = args.runs or (5 if args.quick else 12)
    lines = [
        f"torch {torch.__version__}, timm {timm.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; random weights, fp32",
        "",
    ]
    lines += section_latency(runs) + [""]
    lines += section_ablation(max(5, runs * 2 // 3), args.quick)
    lines += section_memory(1 if args.quick else 3) + [""]
    if args.no_compile:
        lines += ["### 4. torch.compile", "", "skipped (`--no-compile`)", ""]
    else:
        lines += section_compile(min(runs, 10))
    lines += section_fuse(runs + runs // 2, args.quick)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
