"""Record the ATen calls of a forward pass, to compare two formulations kernel by kernel."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Calls that only move or describe data.
DATA_MOVEMENT = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "permute", "transpose", "t", "expand", "select", "slice",
    "unsqueeze", "squeeze", "as_strided", "alias", "detach", "clone", "copy", "contiguous", "empty", "empty_like",
    "empty_strided", "new_empty", "cat", "lift_fresh", "unbind", "split"
})  # fmt: skip

#: Reductions: operands must agree in shape, strides and dtype.
REDUCTIONS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "matmul", "_softmax", "native_layer_norm", "convolution", "_convolution",
    "mkldnn_convolution", "_scaled_dot_product_flash_attention_for_cpu", "mean", "sum", "_fused_rms_norm",
    "rms_norm", "linalg_vector_norm"
})  # fmt: skip

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


def compiled_reference(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, timm's model compiled by inductor; skipped where inductor cannot build it (``ATEN_CPU_CAPABILITY=default``)."""
    import pytest

    try:
        return fn(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        pytest.skip(f"inductor cannot compile timm's own model here: {str(e).splitlines()[0][:200]}")


def compiled_graph(model: torch.nn.Module, x: torch.Tensor, loss: Callable | None = None, dynamic: bool = False) -> Any:
    """The ATen graphs ``torch.compile`` makes of ``model(x)`` for inductor to generate code
    from (decomposed as inductor decomposes, a training step split into forward and backward
    as inductor splits it), in a form in which two models' graphs can be compared."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict[str, Any] = {}

    def backend(traced: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        def recorder(kind: str) -> Callable:
            def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
                graphs[kind] = gm
                return make_boxed_func(gm.forward)

            return record

        graphs["inputs"] = inputs
        return aot_module_simplified(
            traced,
            inputs,
            fw_compiler=recorder("forward"),
            bw_compiler=recorder("backward"),
            decompositions=select_decomp_table(),  # decomposed and partitioned as inductor does
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        )

    torch._dynamo.reset()  # a fresh trace: no shape made dynamic by an earlier compile
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    if dynamic:
        x = x.clone()
        torch._dynamo.mark_dynamic(x, 0)
    if loss is None:
        with torch.inference_mode():
            compiled(x)
    else:
        loss(compiled(x)).backward()
    torch._dynamo.reset()

    forward = graphs["forward"].graph
    primals = [n for n in forward.nodes if n.op == "placeholder"]
    names: dict[torch.fx.Node, Any] = {  # one placeholder per input, parameters included, in order
        n: _input_name(t) for n, t in zip(primals, graphs["inputs"], strict=True)
    }
    outputs = _output_names(forward, names)
    if loss is None:
        return outputs
    backward = graphs["backward"].graph
    placeholders = [n for n in backward.nodes if n.op == "placeholder"]  # saved values, then tangents
    saved = [n for n in placeholders if not n.name.startswith("tangents")]
    tangents = placeholders[len(saved) :]
    returned = len(outputs) - len(saved)  # the forward returns the model's outputs, then the saved values
    names.update(zip(saved, outputs[returned:], strict=True))
    names.update((n, ("tangent", i)) for i, n in enumerate(tangents))
    grads = _output_names(backward, names)
    gradients = sorted((repr(names[n]), repr(g)) for n, g in zip(primals, grads, strict=True))  # one per input
    return outputs[:returned], gradients


def _input_name(t: torch.Tensor | torch.SymInt) -> tuple:
    if isinstance(t, torch.SymInt):
        return ("size", str(t))
    return ("input", tuple(t.shape), hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest())


def _output_names(graph: torch.fx.Graph, names: dict[torch.fx.Node, Any]) -> list[Any]:
    """Name every call of ``graph`` after what it computes (``names`` holds its inputs' names);
    return its outputs' names."""

    def operand(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return names[v]
        return tuple(operand(a) for a in v) if isinstance(v, (list, tuple)) else v

    draws = 0
    for n in graph.nodes:
        if n.op == "output":
            return [operand(v) for v in n.args[0]]
        if n.op == "placeholder":
            continue
        args = tuple(operand(a) for a in n.args)
        if n.target is torch.ops.aten.mul.Tensor:
            args = tuple(sorted(args, key=repr))
        call: tuple = (str(n.target), args, {k: operand(v) for k, v in n.kwargs.items()})
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            call += (("draw", draws),)
            draws += 1
        names[n] = hashlib.sha256(repr(call).encode()).hexdigest()
    raise AssertionError("a graph without an output")
