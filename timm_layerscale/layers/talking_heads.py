"""Talking-heads self-attention (Shazeer et al., arXiv 2003.02436), as used by CaiT.

Three classes compute the same function:

* :class:`TalkingHeadAttn` (the default in :class:`~timm_layerscale.models.cait_ls.CaitLS`):
  the reference formulation, the arithmetic of timm's ``cait_*`` and of the official CaiT code. Training, autograd, dropout, autocast,
  ``torch.compile`` and tracing always run it.
* :class:`BufferedTalkingHeadAttn` (opt-in, ``attn_impl="buffered"``): for CPU inference, the same reductions on the same operands as the reference, with
  the large ``(B, H, N, N)`` intermediates held in three buffers instead of about ten
  fresh tensors. Its outputs are bit-identical to the reference on any CPU.
* :class:`FastTalkingHeadAttn` (opt-in, ``attn_impl="fast"``): mixes heads on the
  contiguous logits with one batched GEMM, which skips four permuted copies but sums
  each length-``H`` mix in an order of the BLAS's choosing. Within a stated tolerance
  of the reference, never bit-exact by construction; verification never uses it.

Why the buffered path is exact by construction: two computations give identical
floats on every machine when every reduction (GEMM, bmm, softmax) is the same ATen
call on operands of identical shape, strides, dtype, values and alignment; data
movement, single elementwise operations in the same order, and where results are
stored may change. Alignment covers the weights too: a BLAS may sum a GEMM on a
weight that is not 16-byte aligned in another order (seen for a one-row GEMM, batch
size 1, on a weight mapped from a safetensors file at 8 mod 16), so both models must
hold their parameters in fresh allocations, as ``timm.create_model(...,
pretrained=True)`` and ``load_state_dict`` without ``assign`` give them.
The reference's ``nn.Linear`` on logits permuted to
``(B, N, N, H)`` is ``torch.matmul`` and an in-place bias add; when the weight
requires grad (its own flag decides, also under ``no_grad`` and ``inference_mode``)
``matmul`` folds the input with ``reshape(-1, H)``, a contiguous copy unless a view
does, and calls ``mm`` with ``weight.t()``. CPU ``softmax`` runs its kernel on
``input.contiguous()`` (``Tensor.softmax`` reaches it as ``_softmax``, which the
buffered path calls directly); ``q @ k^T`` and ``attn @ v`` are ``bmm`` on
``reshape(B * H, ...)`` of their operands. The buffered path makes the same calls, with
each large copy (a copy exactly when ATen's ``reshape`` / ``contiguous`` would make
one) and each large result written into a buffer with the strides of the fresh
tensor it replaces; buffers start at the allocator's alignment, as fresh tensors do.
Each head mix's bias add (one rounding per element) is written straight into the
contiguous copy of the permuted result that the next step makes anyway.
With frozen mixing weights (``requires_grad_(False)``) ``matmul`` takes a
stride-dependent ``mm`` / ``bmm`` choice instead, and the buffered class runs the
reference formulation. The parity tests record the ATen calls of both classes and
compare them operand by operand, and run both under several CPU kernel dispatches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _every_module

from .attention import MultiHeadAttention

__all__ = [
    "TalkingHeadAttn",
    "BufferedTalkingHeadAttn",
    "FastTalkingHeadAttn",
    "ATTN_IMPLS",
    "FAST_ATTN_RTOL",
    "attention_workspace",
]

#: Bound of :class:`FastTalkingHeadAttn` against the reference, relative to the output's
#: largest magnitude, per dtype (see its docstring).
FAST_ATTN_RTOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class TalkingHeadAttn(MultiHeadAttention):
    """Multi-head self-attention with talking heads: the reference formulation.

    Heads are mixed by ``proj_l`` (a ``(H, H)`` linear map over the head axis) on the
    attention logits before the softmax, and by ``proj_w`` after it:
    ``attn = proj_w(softmax(proj_l(q k^T / sqrt(d))))``, ``out = proj(attn v)``.

    Args:
        dim: Token width ``C``; divisible by ``num_heads``.
        num_heads: Heads ``H``.
        qkv_bias: Bias on the qkv projection.
        attn_drop: Dropout on the mixed attention weights.
        proj_drop: Dropout after the output projection.
        device: Device to build on.
        dtype: Parameter dtype.
    """

    def _build_attend(self, **dd: Any) -> None:
        self.proj_l = nn.Linear(self.num_heads, self.num_heads, **dd)
        self.proj_w = nn.Linear(self.num_heads, self.num_heads, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``. Returns: ``(B, N, C)``."""
        B, N, C = x.shape
        qkv = self._split_qkv(x)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = attn.softmax(dim=-1)
        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self._project(x)

    @torch.jit.ignore
    def _eager_inference(self, x: torch.Tensor) -> bool:
        """True for a non-empty batch on CPU when no autograd, autocast, dropout, compiler or tracer is
        involved, and the layers the other paths do not call (they read the head mixes' weights and
        skip the dropout) are plain ``nn.Linear`` / ``nn.Dropout`` without hooks, their own or every
        module's: a quantized or adapted layer, a hook that reads the attention map, a module tracker
        or a pruning mask keeps the reference."""
        if isinstance(x, torch.fx.Proxy) or x.device.type != "cpu":  # an FX trace records the reference
            return False
        if _every_module._global_forward_hooks or _every_module._global_forward_pre_hooks:
            return False
        for m, plain in ((self.proj_l, nn.Linear), (self.proj_w, nn.Linear), (self.attn_drop, nn.Dropout)):
            if type(m) is not plain or m._forward_hooks or m._forward_pre_hooks:
                return False
        if x.shape[0] == 0:  # nothing to save: buffers of no elements cannot take the reshapes
            return False
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return False
        if torch.is_autocast_enabled("cpu") or (self.training and self.attn_drop.p > 0.0):
            return False
        return not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in self.parameters()))


#: The shared buffers of an :func:`attention_workspace`, three per (dtype, device).
_Workspace = dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]
_WORKSPACE: ContextVar[_Workspace | None] = ContextVar("timm_layerscale_attention_workspace", default=None)


@contextmanager
def _workspace() -> Iterator[None]:
    token = _WORKSPACE.set({})
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


def attention_workspace() -> AbstractContextManager[None]:
    """Share the buffered attention's buffers between the calls inside the ``with`` block, in
    the thread (or asyncio task) that enters it; other threads keep their own.

    A model runs its blocks inside one, so a forward pass allocates the three
    ``(B, H, N, N)`` buffers once instead of once per block; they are released when
    the block ends. Outside one, each call allocates its own. Under ``torch.compile``
    it does nothing (the reference formulation runs there).
    """
    if torch.compiler.is_compiling():
        return nullcontext()
    return _workspace()


def _buffers(numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Three flat buffers of ``numel`` elements, shared within an :func:`attention_workspace`.

    Shared buffers grow to the largest request; a smaller one gets their first
    ``numel`` elements, so every buffer starts at an allocation's start.
    """
    shared = _WORKSPACE.get()
    key = (like.dtype, like.device)
    if shared is not None and key in shared and shared[key][0].numel() >= numel:
        return [b[:numel] for b in shared[key]]
    bufs = [torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(3)]
    if shared is not None:
        shared[key] = bufs
    return bufs


def _reshape_into(t: torch.Tensor, shape: tuple[int, ...], buf: torch.Tensor) -> torch.Tensor:
    """``t.reshape(shape)``: a view where ATen's reshape gives one, else its contiguous copy made in ``buf``."""
    try:
        return t.view(shape)
    except RuntimeError:
        return buf[: t.numel()].view(t.shape).copy_(t).view(shape)


def _mix_heads_into(
    t: torch.Tensor,
    linear: nn.Linear,
    scratch: torch.Tensor,
    out: torch.Tensor,
    into: torch.Tensor,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``linear(t).permute(0, 3, 1, 2)`` for ``t`` of shape ``(B, N, N, H)``, as ``nn.Linear`` computes it,
    then as the next step takes it: ``.contiguous()`` (``shape=None``) or ``.reshape(shape)``.

    For a non-contiguous input whose weight requires grad, ``nn.Linear`` is
    ``matmul(t, weight.t())`` folded to ``mm(t.reshape(-1, H), weight.t())``, then an
    in-place bias add. This makes the same ``mm``, with the reshape's copy (if any) made
    in ``scratch`` and the product in ``out``. Where the next step copies the permuted
    result (a copy exactly where ATen's ``contiguous`` / ``reshape`` makes one), the bias
    add is written straight into that copy in ``into``: the same additions, one rounding
    each, one pass fewer; elsewhere it is added in place. A contiguous input takes
    ``nn.Linear`` itself (one ``addmm``).
    """
    if t.is_contiguous():
        y, bias = F.linear(t, linear.weight, linear.bias).permute(0, 3, 1, 2), None
    else:
        B, N, M, H = t.shape
        a = _reshape_into(t, (-1, H), scratch)
        n = linear.out_features
        y = torch.mm(a, linear.weight.t(), out=out[: a.shape[0] * n].view(a.shape[0], n))
        y, bias = y.view(B, N, M, n).permute(0, 3, 1, 2), linear.bias
    taken: torch.Tensor | None = y if y.is_contiguous() else None
    if shape is not None:
        try:
            taken = y.view(shape)
        except RuntimeError:
            taken = None
    if taken is not None:  # no copy follows: the bias goes in place, as nn.Linear adds it
        if bias is not None:
            y.add_(bias.view(-1, 1, 1))
        return taken
    dst = into[: y.numel()].view(y.shape)
    copy = torch.add(y, bias.view(-1, 1, 1), out=dst) if bias is not None else dst.copy_(y)
    return copy if shape is None else copy.view(shape)


class BufferedTalkingHeadAttn(TalkingHeadAttn):
    """:class:`TalkingHeadAttn` whose CPU inference keeps the ``(B, H, N, N)`` tensors in three buffers.

    Bit-identical to the reference on any CPU (module docstring: the same ATen
    reductions on the same operands). It runs when ``TalkingHeadAttn._eager_inference``
    holds; otherwise, and on other devices (whose caching allocators already reuse
    memory), the reference formulation runs, so gradients, dropout masks and compiled
    or exported graphs are the reference's.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``. Returns: ``(B, N, C)``."""
        if not (self._eager_inference(x) and self.proj_l.weight.requires_grad and self.proj_w.weight.requires_grad):
            return super().forward(x)
        return self._forward_buffered(x)

    @torch.jit.ignore
    def _forward_buffered(self, x: torch.Tensor) -> torch.Tensor:
        # Each step is the reference's, with every (B, H, N, N)-sized result or copy
        # written into one of three flat buffers (views from offset 0) instead of a fresh tensor.
        B, N, C = x.shape
        H = self.num_heads
        qkv = self._split_qkv(x)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        buf = _buffers(B * H * N * N, qkv)
        logits = torch.bmm(
            q.reshape(B * H, N, -1), k.transpose(-2, -1).reshape(B * H, -1, N), out=buf[0].view(B * H, N, N)
        ).view(B, H, N, N)
        attn = _mix_heads_into(logits.permute(0, 2, 3, 1), self.proj_l, buf[1], buf[2], buf[0])
        attn = torch._softmax(attn, -1, False, out=buf[1].view(B, H, N, N))
        attn = _mix_heads_into(attn.permute(0, 2, 3, 1), self.proj_w, buf[0], buf[2], buf[0], (B * H, N, N))
        x = torch.bmm(attn, v.reshape(B * H, N, -1))
        x = x.view(B, H, N, -1).transpose(1, 2).reshape(B, N, C)
        return self._project(x)


class FastTalkingHeadAttn(TalkingHeadAttn):
    """:class:`TalkingHeadAttn` that mixes heads on the contiguous logits (opt-in, not exact).

    Each mix is ``W @ logits.view(B, H, N * N)`` (one batched GEMM) plus the bias,
    which skips the reference's four permuted copies of the ``(B, H, N, N)`` tensor.
    An output element is still a length-``H`` dot product over the same operands,
    but another GEMM kernel sums it, so the order of the ``H`` additions differs.

    Bound: each mixed logit differs from the reference's by at most
    ``2 * gamma_H * sum_h |W[o, h] * a[h]|`` (``gamma_H = H * u / (1 - H * u)``,
    ``u`` the unit roundoff: ``2**-24`` fp32, ``2**-8`` bf16), i.e. a few ulp of the
    terms' magnitude (fp32, ``H = 16``: ``2e-6`` relative). Softmax and the layers
    after it carry such differences to the output at a similar relative size, so the
    check against the reference is ``|fast - ref| <= rtol * max|ref|`` per tensor with
    :data:`FAST_ATTN_RTOL`: fp32 ``1e-5``, about 17x the largest difference measured
    (``5.8e-7`` across the test shapes under the AVX-512, AVX2 and default kernel
    dispatches); bf16 ``5e-2``, 7x the measured ``7.4e-3`` (one extra bf16 rounding of
    the logits where the reference adds the bias inside the GEMM). Runs under the same
    conditions as :class:`BufferedTalkingHeadAttn`, else the reference formulation.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: tokens ``(B, N, C)``. Returns: ``(B, N, C)``."""
        if not self._eager_inference(x):
            return super().forward(x)
        return self._forward_fast(x)

    @torch.jit.ignore
    def _forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(B, N, 3, H, d)
        dd = {"device": qkv.device, "dtype": qkv.dtype}
        q = torch.empty(B, H, N, d, **dd)
        torch.mul(qkv[:, :, 0].transpose(1, 2), self.scale, out=q)
        k_t = qkv[:, :, 1].permute(0, 2, 3, 1).contiguous()
        v = qkv[:, :, 2].transpose(1, 2).contiguous()
        logits = torch.empty(B, H, N, N, **dd)
        mixed = torch.empty_like(logits)
        torch.bmm(q.view(B * H, N, d), k_t.view(B * H, d, N), out=logits.view(B * H, N, N))
        self._mix(logits, self.proj_l, mixed)
        torch.softmax(mixed, dim=-1, out=logits)
        self._mix(logits, self.proj_w, mixed)
        out = torch.bmm(mixed.view(B * H, N, N), v.view(B * H, N, d), out=q.view(B * H, N, d))
        x = out.view(B, H, N, d).transpose(1, 2).reshape(B, N, C)
        return self._project(x)

    @staticmethod
    def _mix(attn: torch.Tensor, linear: nn.Linear, out: torch.Tensor) -> None:
        B, H, N, M = attn.shape
        torch.matmul(linear.weight, attn.view(B, H, N * M), out=out.view(B, H, N * M))
        if linear.bias is not None:
            out += linear.bias.view(H, 1, 1)


#: ``attn_impl`` values of :class:`~timm_layerscale.models.cait_ls.CaitLS` and their classes.
ATTN_IMPLS = {"reference": TalkingHeadAttn, "buffered": BufferedTalkingHeadAttn, "fast": FastTalkingHeadAttn}
