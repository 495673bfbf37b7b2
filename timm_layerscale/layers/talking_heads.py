"""CPU inference paths of talking-heads attention (Shazeer et al., arXiv 2003.02436), functions of a timm
``TalkingHeadAttn`` that :mod:`~timm_layerscale.models.cait_ls` subclasses it with: :func:`buffered_attention`,
bit-identical to it on any CPU (the parity guide gives the argument), and :func:`fast_attention`, within
:data:`FAST_ATTN_RTOL` of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _every_module

__all__ = ["FAST_ATTN_RTOL", "attention_workspace", "buffered_attention", "eager_inference", "fast_attention"]

#: Bound of :func:`fast_attention` against the reference, relative to the output's largest magnitude.
FAST_ATTN_RTOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}

_WORKSPACE: ContextVar[dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] | None] = ContextVar(
    "timm_layerscale_attention_workspace", default=None
)


@contextmanager
def _workspace() -> Iterator[None]:
    token = _WORKSPACE.set({})
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


def attention_workspace() -> AbstractContextManager[None]:
    """Share the buffered attention's three buffers between the calls inside the block, in the thread (or
    asyncio task) that enters it, so that a forward pass allocates them once; nothing under ``torch.compile``."""
    return nullcontext() if torch.compiler.is_compiling() else _workspace()


def eager_inference(attn: Any, x: torch.Tensor) -> bool:
    """Whether ``attn`` may take a path other than the reference's on ``x``: a non-empty CPU batch with no
    autograd, autocast, dropout, compiler or tracer involved, and plain ``nn.Linear`` head mixes and
    ``nn.Dropout`` without hooks of their own or every module's (a quantized or adapted layer, a hook that
    reads the attention map or a pruning mask keeps the reference)."""
    if isinstance(x, torch.fx.Proxy) or x.device.type != "cpu" or x.shape[0] == 0:
        return False
    if _every_module._global_forward_hooks or _every_module._global_forward_pre_hooks:
        return False
    for m, plain in ((attn.proj_l, nn.Linear), (attn.proj_w, nn.Linear), (attn.attn_drop, nn.Dropout)):
        if type(m) is not plain or m._forward_hooks or m._forward_pre_hooks:
            return False
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return False
    if attn.training and attn.attn_drop.p > 0.0:
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in attn.parameters()))


def _buffers(numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Three flat buffers of ``numel`` elements, shared within an :func:`attention_workspace` (grown to the
    largest request; a smaller one gets their first elements, so every buffer starts an allocation)."""
    shared, key = _WORKSPACE.get(), (like.dtype, like.device)
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
    t: torch.Tensor, linear: nn.Linear, scratch: torch.Tensor, out: torch.Tensor, into: torch.Tensor, shape: Any = None
) -> torch.Tensor:
    """``linear(t).permute(0, 3, 1, 2)`` for ``t`` ``(B, N, N, H)``, then ``.contiguous()`` (``shape=None``) or
    ``.reshape(shape)``: ``nn.Linear``'s ``mm(t.reshape(-1, H), weight.t())`` with the reshape's copy in
    ``scratch`` and the product in ``out``, and its bias add written into the next step's copy in ``into``."""
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


def buffered_attention(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """timm's ``TalkingHeadAttn.forward`` on tokens ``(B, N, C)``, its ``(B, H, N, N)`` results and copies in
    three buffers (views from offset 0, with the strides of the fresh tensors they replace)."""
    B, N, C = x.shape
    H = attn.num_heads
    qkv = attn.qkv(x).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * attn.scale, qkv[1], qkv[2]
    buf = _buffers(B * H * N * N, qkv)
    logits = torch.bmm(
        q.reshape(B * H, N, -1), k.transpose(-2, -1).reshape(B * H, -1, N), out=buf[0].view(B * H, N, N)
    ).view(B, H, N, N)
    a = _mix_heads_into(logits.permute(0, 2, 3, 1), attn.proj_l, buf[1], buf[2], buf[0])
    a = torch._softmax(a, -1, False, out=buf[1].view(B, H, N, N))  # Tensor.softmax's kernel on a contiguous input
    a = _mix_heads_into(a.permute(0, 2, 3, 1), attn.proj_w, buf[0], buf[2], buf[0], (B * H, N, N))
    x = torch.bmm(a, v.reshape(B * H, N, -1)).view(B, H, N, -1).transpose(1, 2).reshape(B, N, C)
    return attn.proj_drop(attn.proj(x))


def fast_attention(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """Talking-heads attention on tokens ``(B, N, C)`` with each head mix one GEMM ``W @ logits.view(B, H, N * N)``:
    the same length-``H`` dot products, summed in the GEMM kernel's order."""
    B, N, C = x.shape
    H = attn.num_heads
    d = C // H
    qkv = attn.qkv(x).view(B, N, 3, H, d)
    dd = {"device": qkv.device, "dtype": qkv.dtype}
    q = torch.empty(B, H, N, d, **dd)
    torch.mul(qkv[:, :, 0].transpose(1, 2), attn.scale, out=q)
    k_t = qkv[:, :, 1].permute(0, 2, 3, 1).contiguous()
    v = qkv[:, :, 2].transpose(1, 2).contiguous()
    logits, mixed = torch.empty(B, H, N, N, **dd), torch.empty(B, H, N, N, **dd)
    torch.bmm(q.view(B * H, N, d), k_t.view(B * H, d, N), out=logits.view(B * H, N, N))

    def mix(a: torch.Tensor, linear: nn.Linear) -> None:
        torch.matmul(linear.weight, a.view(B, H, N * N), out=mixed.view(B, H, N * N))
        if linear.bias is not None:
            mixed.add_(linear.bias.view(H, 1, 1))

    mix(logits, attn.proj_l)
    torch.softmax(mixed, dim=-1, out=logits)
    mix(logits, attn.proj_w)
    out = torch.bmm(mixed.view(B * H, N, N), v.view(B * H, N, d), out=q.view(B * H, N, d))
    return attn.proj_drop(attn.proj(out.view(B, H, N, d).transpose(1, 2).reshape(B, N, C)))
