"""The buffered talking-heads attention is timm's arithmetic by construction, on any CPU."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from timm.layers import set_fused_attn, use_fused_attn
from timm.models.cait import TalkingHeadAttn
from timm.models.cait import TalkingHeadAttn as RefAttn
from torch import nn

from helpers import ROOT, TINY_CAIT, images, randomize, tiny_pair
from kernel_trace import reduction_trace
from timm_layerscale import to_layerscale
from timm_layerscale.layers.talking_heads import FAST_ATTN_RTOL
from timm_layerscale.models.cait_ls import BufferedTalkingHeadAttn, CaitLS, FastTalkingHeadAttn

TINY = TINY_CAIT
#: (B, N, C, H): real sizes, a single image, a single token, a single head.
SHAPES = [
    (2, 17, 32, 4),
    (3, 50, 96, 6),
    (2, 197, 128, 8),
    (1, 65, 256, 16),
    (1, 5, 48, 6),
    (2, 1, 32, 4),
    (3, 7, 16, 1),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _attn_pair(C: int, H: int, dtype: torch.dtype, cls: type = BufferedTalkingHeadAttn) -> tuple[nn.Module, nn.Module]:
    ref = randomize(RefAttn(C, num_heads=H, qkv_bias=True)).eval().to(dtype)
    ours = cls(C, num_heads=H, qkv_bias=True).eval().to(dtype)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _tokens(B: int, N: int, C: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(B, N, C, generator=torch.Generator().manual_seed(B * N + C)).to(dtype)


@pytest.fixture
def buffered_calls(monkeypatch):
    """Shapes the buffered formulation ran on (it falls back to the reference elsewhere)."""
    calls = []
    original = BufferedTalkingHeadAttn._buffered

    def spy(self, x):
        calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(BufferedTalkingHeadAttn, "_buffered", spy)
    return calls


@pytest.fixture
def fused_attn():
    initial = use_fused_attn()
    yield set_fused_attn
    set_fused_attn(initial)


@pytest.mark.compat
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,N,C,H", SHAPES)
def test_buffered_attention_makes_timms_kernel_calls(B, N, C, H, dtype, buffered_calls):
    ref, ours = _attn_pair(C, H, dtype)
    x = _tokens(B, N, C, dtype)
    expected = reduction_trace(lambda: ref(x))
    got = reduction_trace(lambda: ours(x))
    assert buffered_calls == [x.shape], "the buffered formulation ran"
    assert [c[0] for c in got] == [c[0] for c in expected]
    assert got == expected
    with torch.inference_mode():
        assert torch.equal(ours(x), ref(x))


@pytest.mark.compat
def test_frozen_mixing_weights_take_the_reference_formulation(buffered_calls):
    # With requires_grad off, matmul picks mm or bmm by stride; the buffered path then steps aside.
    ref, ours = _attn_pair(48, 6, torch.float32)
    ref.requires_grad_(False)
    ours.requires_grad_(False)
    x = _tokens(1, 5, 48, torch.float32)
    assert reduction_trace(lambda: ours(x)) == reduction_trace(lambda: ref(x))
    assert buffered_calls == []
    with torch.inference_mode():
        assert torch.equal(ours(x), ref(x))


@pytest.mark.compat
@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "unfused_attn"])
def test_model_makes_timms_kernel_calls(fused, fused_attn, buffered_calls):
    fused_attn(fused)
    ref, ours = tiny_pair(attn_impl="buffered")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = reduction_trace(lambda: ref(x))
    got = reduction_trace(lambda: ours(x))
    assert len(buffered_calls) == TINY["depth"]
    assert got == expected


def test_path_selection(buffered_calls):
    attn = BufferedTalkingHeadAttn(32, num_heads=4, qkv_bias=True).eval()
    x = torch.randn(1, 5, 32)
    with torch.inference_mode():
        attn(x)
    with torch.no_grad():
        attn(x)
    assert len(buffered_calls) == 2
    attn(x)  # autograd records: the reference formulation, so gradients are timm's
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x)
    dropping = BufferedTalkingHeadAttn(32, num_heads=4, attn_drop=0.1).train()
    with torch.no_grad():
        dropping(x)
        assert len(buffered_calls) == 2
        dropping.eval()(x)
    assert len(buffered_calls) == 3
    with torch.no_grad():
        TalkingHeadAttn(32, num_heads=4).eval()(x)
    assert len(buffered_calls) == 3


def test_attention_workspace_shares_buffers_and_keeps_outputs_apart(buffered_calls):
    from timm_layerscale.layers.talking_heads import attention_workspace

    ref, ours = _attn_pair(32, 4, torch.float32)
    x1, x2 = _tokens(2, 9, 32, torch.float32), _tokens(3, 9, 32, torch.float32)
    with torch.inference_mode():
        with attention_workspace():
            a = ours(x1)
            b = ours(x2)  # larger: the shared buffers grow
            c = ours(x1)  # smaller: served from the larger buffers (views from offset 0)
        assert torch.equal(a, ref(x1)) and torch.equal(b, ref(x2)) and torch.equal(c, a)
    assert len(buffered_calls) == 3


@pytest.mark.compat
@pytest.mark.parametrize("name,fused", [("cait_xxs24_224", True), ("cait_xxs24_224", False)])
@pytest.mark.full
def test_cait_xxs24_bit_exact_eval_and_train(name, fused, fused_attn, buffered_calls):
    fused_attn(fused)
    ref = randomize(timm.create_model(name)).eval()
    ours = timm.create_model(name + "_ls", attn_impl="buffered").eval()
    assert isinstance(ours, CaitLS)
    ours.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
    attn = "blocks_token_only.0.attn"
    assert ours.get_submodule(attn).fused_attn == ref.get_submodule(attn).fused_attn == fused
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = ref(x)
        assert torch.equal(ours(x), expected)
    assert len(buffered_calls) == len(ours.blocks)
    with torch.no_grad():
        ref.train()
        ours.train()
        assert torch.equal(ours(x), ref(x))
    for dtype in (torch.bfloat16, torch.float16):
        half_ref, half_ours = copy.deepcopy(ref).eval().to(dtype), copy.deepcopy(ours).eval().to(dtype)
        with torch.inference_mode():
            assert torch.equal(half_ours(x.to(dtype)), half_ref(x.to(dtype))), dtype


DISPATCHES = {
    "best": ({}, None),
    # Every library at its lowest ISA: oneDNN left at its best would pick AMX kernels whose packing
    # routine an ATen built for no AVX lacks (bf16 attention then fails on AMX CPUs, in timm's models too).
    "aten-default": (
        {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
        ("DEFAULT", "NO AVX"),  # the name differs by torch version
    ),
    "aten-avx2-mkl-avx2": (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        ("AVX2",),
    ),
}


def run_under_dispatch(
    dispatch: str, script: str, *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``tests/SCRIPT`` in a fresh interpreter under a kernel dispatch of :data:`DISPATCHES`; its JSON line."""
    env_update, capability = DISPATCHES[dispatch]
    if capability == ("AVX2",) and "avx2" not in Path("/proc/cpuinfo").read_text(errors="ignore"):
        pytest.skip("this CPU has no AVX2")
    variables = {name for update, _ in DISPATCHES.values() for name in update}
    run_env = {k: v for k, v in os.environ.items() if k not in variables}
    run_env.update(env_update, **(env or {}))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if capability:
        assert result["capability"] in capability
    return result


@pytest.mark.parametrize(
    "dispatch", [pytest.param(d, marks=pytest.mark.compat) if d == "aten-default" else d for d in DISPATCHES]
)
@pytest.mark.full
def test_exact_parity_under_other_kernel_dispatch(dispatch):
    result = run_under_dispatch(dispatch, "exact_parity_check.py")
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert len(result["checks"]) == 12
    assert not failed, f"not bit-exact under {dispatch} ({result['capability']}): {failed}"


def _within_fast_bound(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    rtol = FAST_ATTN_RTOL[expected.dtype]
    err = (got.float() - expected.float()).abs().max().item()
    return err, rtol * expected.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,N,C,H", SHAPES)
def test_fast_attention_within_its_bound(B, N, C, H, dtype):
    ref, fast = _attn_pair(C, H, dtype, FastTalkingHeadAttn)
    x = _tokens(B, N, C, dtype)
    with torch.inference_mode():
        err, bound = _within_fast_bound(fast(x), ref(x))
    assert err <= bound


@pytest.mark.full
def test_fast_model_within_its_bound_and_trains_like_the_reference():
    ref = randomize(timm.create_model("cait_xxs24_224")).eval()
    fast = timm.create_model("cait_xxs24_224_ls", attn_impl="fast").eval()
    assert isinstance(fast.get_submodule("blocks.0.attn"), FastTalkingHeadAttn)
    fast.load_state_dict(to_layerscale(ref.state_dict(), "cait"), strict=True)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        err, bound = _within_fast_bound(fast(x), ref(x))
    assert err <= bound
    ref.train()
    fast.train()
    assert torch.equal(fast(x), ref(x)), "with autograd recording, the reference formulation runs"


@pytest.mark.parametrize("impl", ["buffered", "fast"])
def test_threads_running_one_model_at_once_keep_their_own_buffers(impl):
    """A server's threads calling one model at the same time, at different batch sizes: each
    gets the output its input gives alone (the shared buffers belong to one call's context)."""
    from concurrent.futures import ThreadPoolExecutor

    _, ours = tiny_pair(attn_impl=impl)
    inputs = [images(n, TINY["img_size"], seed=n) for n in (1, 2, 3, 5)] * 4
    with torch.inference_mode():
        alone = [ours(x) for x in inputs]

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return ours(x)

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, inputs))
    assert all(map(torch.equal, together, alone))


@pytest.mark.parametrize("where", ["proj_l", "attn_drop", "pruned proj_w", "global hook"])
@pytest.mark.parametrize("impl", ["reference", "buffered", "fast"])
def test_hooks_and_pruning_on_the_head_mixes_hold_on_every_path(impl, where):
    """A forward hook on ``proj_l`` (the mixed logits) or ``attn_drop`` (the attention map) is
    called in every block, and a pruning mask on ``proj_w`` (a forward pre-hook) applies, as in
    timm's model. So is a hook registered for every module (``register_module_forward_hook``, as
    module trackers and profilers do), here keeping what ``proj_l`` gives."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.nn.utils import prune

    ref, ours = tiny_pair(attn_impl=impl)
    seen: dict[str, list[torch.Tensor]] = {"ref": [], "ours": []}
    mixes: dict[nn.Module, str] = {}
    for name, model in (("ref", ref), ("ours", ours)):
        for attn in (m for m in model.modules() if isinstance(m, (RefAttn, TalkingHeadAttn))):
            if where == "pruned proj_w":
                prune.l1_unstructured(attn.proj_w, "weight", amount=0.5)
            elif where == "global hook":
                mixes[attn.proj_l] = name
            else:
                layer = getattr(attn, where)
                layer.register_forward_hook(lambda m, i, o, name=name: seen[name].append(o.clone()))

    def keep_mixed_logits(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if module in mixes:
            seen[mixes[module]].append(out.clone())

    # only in its own case: while it is registered, every path runs the reference formulation
    hook = register_module_forward_hook(keep_mixed_logits) if where == "global hook" else contextlib.nullcontext()
    x = images(2, TINY["img_size"])
    with hook, torch.inference_mode():  # the handle removes the hook on leaving
        assert torch.equal(ours(x), ref(x))
    assert len(seen["ours"]) == (0 if where.startswith("pruned") else TINY["depth"])
    assert all(map(torch.equal, seen["ours"], seen["ref"]))


def test_attn_impl_argument():
    assert type(CaitLS(**TINY).blocks[0].attn) is TalkingHeadAttn
    assert type(CaitLS(**TINY, attn_impl="buffered").blocks[0].attn) is BufferedTalkingHeadAttn
    assert type(CaitLS(**TINY, attn_impl="reference").blocks[0].attn) is TalkingHeadAttn
    with pytest.raises(ValueError, match="attn_impl must be one of 'reference', 'buffered', 'fast'"):
        CaitLS(**TINY, attn_impl="flash")
