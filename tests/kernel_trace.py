"""Record the ATen calls of a forward pass, to compare two formulations kernel by kernel.

Two computations are bit-identical on every machine when every reduction is the same
ATen call on operands of the same shape, strides and dtype (values follow by
induction when the inputs are equal). :func:`reduction_trace` lists those calls; data
movement (views, copies) and ``out=`` / in-place variants are free to differ, so they
are left out or normalised. Elementwise calls are kept by name only: each rounds once
per element whatever the layout, so their order is what has to agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Calls that only move or describe data.
DATA_MOVEMENT = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",
        "permute",
        "transpose",
        "t",
        "expand",
        "select",
        "slice",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "clone",
        "copy",
        "contiguous",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "cat",
        "lift_fresh",
        "unbind",
        "split",
    }
)

#: Reductions: operands must agree in shape, strides and dtype.
REDUCTIONS = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "matmul",
        "_softmax",
        "native_layer_norm",
        "convolution",
        "_convolution",
        "mkldnn_convolution",
        "_scaled_dot_product_flash_attention_for_cpu",
        "mean",
        "sum",
        "_fused_rms_norm",
        "rms_norm",
        "linalg_vector_norm",
    }
)

#: Reductions whose CPU kernel runs on ``input.contiguous()``: only the values reach it.
CONTIGUOUS_INPUT = frozenset({"_softmax"})


def _name(func: Any) -> str:
    name = func.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _operand(t: torch.Tensor, contiguous: bool) -> tuple:
    strides = torch.empty(t.shape).stride() if contiguous else t.stride()
    return (tuple(t.shape), tuple(strides), t.dtype)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name not in DATA_MOVEMENT:
            if name in REDUCTIONS:
                out = kwargs.get("out")
                tensors = [a for a in args if isinstance(a, torch.Tensor) and a is not out]
                contiguous = name in CONTIGUOUS_INPUT
                self.calls.append((name, tuple(_operand(t, contiguous) for t in tensors)))
            else:
                self.calls.append((name,))
        return func(*args, **kwargs)


def reduction_trace(fn: Callable[[], Any]) -> list[tuple]:
    """The ATen calls ``fn()`` makes: reductions with their operands, elementwise calls by name."""
    with torch.no_grad(), _Recorder() as rec:
        fn()
    return rec.calls
