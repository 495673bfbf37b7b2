"""Record the ATen calls of a forward pass, to compare two formulations kernel by kernel.

Two computations are bit-identical on every machine when every reduction is the same
ATen call on operands of the same shape, strides and dtype (values follow by
induction when the inputs are equal). :func:`reduction_trace` lists those calls; data
movement (views, copies) and ``out=`` / in-place variants are free to differ, so they
are left out or normalised. Elementwise calls are kept by name only: each rounds once
per element whatever the layout, so their order is what has to agree. :func:`compiled_graph`
gives the ATen graph ``torch.compile`` makes of a forward pass, for the same comparison of two
compiled models: one graph, one generated code.
"""

from __future__ import annotations

import hashlib
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


def compiled_graph(model: torch.nn.Module, x: torch.Tensor) -> list[tuple]:
    """The ATen graph ``torch.compile`` makes of ``model(x)`` for inference, in a form in which
    two models' graphs can be compared: each input named by its shape and values (a parameter of
    one model matches the equal one of the other, whatever their names and order), each node by
    its position, and the operands of a multiply sorted (``a * b`` rounds as ``b * a``)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[tuple[torch.fx.GraphModule, list[torch.Tensor]]] = []

    def backend(traced: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
            graphs.append((gm, inputs))
            return gm.forward

        return aot_module_simplified(traced, inputs, fw_compiler=record)

    torch._dynamo.reset()  # a fresh trace: no shape made dynamic by an earlier compile
    with torch.inference_mode():
        torch.compile(model, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    ((graph, inputs),) = graphs
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    names: dict[torch.fx.Node, Any] = {  # one placeholder per input, parameters included, in order
        n: ("input", tuple(t.shape), hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest())
        for n, t in zip(placeholders, inputs, strict=True)
    }

    def operand(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return names[v]
        return tuple(operand(a) for a in v) if isinstance(v, (list, tuple)) else v

    nodes: list[tuple] = []
    for n in graph.graph.nodes:
        if n.op != "placeholder":
            args = tuple(operand(a) for a in n.args)
            if n.target is torch.ops.aten.mul.Tensor:
                args = tuple(sorted(args, key=repr))
            names[n] = f"%{len(nodes)}"
            nodes.append((str(n.target), args, {k: operand(v) for k, v in n.kwargs.items()}))
    return nodes
