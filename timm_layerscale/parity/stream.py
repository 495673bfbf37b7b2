"""Verification in bounded memory: a model built with its parameters on the meta device (the buffers it computes
real), whose blocks' weights are read from the state dict (memory-mapped) as each block runs and freed after it. The
batches of an input group run in lockstep, one at a time, each in a thread of its own: every batch passes block i
before any passes block i + 1, so a block's weights are read once per group, and each batch meets each layer with the
operands the in-memory path gives it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..conversion.rules import Cast, cast_tensors, check_state_dict

__all__ = ["StreamedModel", "blocks_of", "build_streamed", "parameters_on_meta"]

_MAPPED_FLOATS = (32 << 20) // 4 + 1024  # fp32 numbers in just over 32 MiB, the largest allocation glibc may not map


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers in the block is moved to the meta device, its buffers kept: a model built
    inside holds no weights but computes its constant buffers (rotary periods, position indices) as it would."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, None if param is None else nn.Parameter(param.to("meta"), param.requires_grad))

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` in the order it holds them: the members of its innermost module lists (or sequences)
    of two or more modules of one class that hold parameters (ViT's ``blocks``, CaiT's and XCiT's class-attention
    blocks after them, ConvNeXt's blocks of each stage, transformers' ``encoder.layer``)."""
    found: list[nn.Module] = []
    for child in model.children():
        found += blocks_of(child)
    kids = list(model.children())
    uniform = len(kids) >= 2 and len({type(k) for k in kids}) == 1
    if not found and isinstance(model, (nn.ModuleList, nn.Sequential)) and uniform:
        found = [k for k in kids if any(True for _ in k.parameters())]
    return found


def _fresh(
    tensors: Mapping[str, torch.Tensor], rounded: set[str], dtype: torch.dtype | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """``tensors`` in fresh memory on ``device``, floating point ones as fp32 (those in ``rounded`` first rounded to
    ``dtype``, a written file's), never a tensor mapped from a file, whose alignment could change how a kernel sums.
    The floating point ones are views of one allocation of at least 32 MiB (its pages beyond them never touched), each
    at a multiple of 64 bytes as torch aligns its own: freed at once, it goes back to the system."""
    floats = {k: v for k, v in tensors.items() if v.is_floating_point()}
    starts, total = {}, 0
    for key, value in floats.items():
        starts[key], total = total, total + -(-value.numel() // 16) * 16
    # glibc's malloc maps anything above 32 MiB apart and unmaps it when freed; a smaller block's weights would be
    # carved from the heap, which the activations between two blocks fragment until it holds every block read
    flat = torch.empty(max(total, _MAPPED_FLOATS), dtype=torch.float32, device=device)
    out = {}
    for key, value in tensors.items():
        if key in floats:
            target = flat[starts[key] : starts[key] + value.numel()].view(value.shape)
            out[key] = target.copy_(value.to(dtype) if dtype is not None and key in rounded else value)
        else:
            out[key] = torch.empty(value.shape, dtype=value.dtype, device=device).copy_(value)
    return out


@functools.cache
def _malloc_trim() -> Callable[[int], int]:
    """glibc's ``malloc_trim``, or where there is none a function that does nothing."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


def _trim() -> None:
    """The free pages of every malloc heap given back to the system: the activations and casts between two blocks
    fragment the heaps, whose free pages would otherwise stay counted, a block's worth or more each time."""
    _malloc_trim()(0)


class StreamedModel:
    """A model whose blocks' parameters stay in ``tensors`` (its filtered state dict) until the block runs.

    Args:
        model: Built in :func:`parameters_on_meta`, in eval mode.
        tensors: Its state dict (strictly its keys and shapes), as the layout's filter made it; a cast view
            (:func:`~timm_layerscale.conversion.rules.cast_tensors`) is read uncast and rounded as it casts.
        dtype: The written file's dtype its parameters are rounded to first (``None``: as they are).
        device: Where it computes.
    """

    def __init__(
        self, model: nn.Module, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device
    ) -> None:
        self.rounded = {k for k, _ in model.named_parameters()}  # the keys rounded to dtype as they are copied
        if isinstance(tensors, Cast):  # uncast, so that no block's worth of cast copies is read at once
            self.rounded = {k for k in tensors.tensors if k not in tensors.keep}
            dtype, tensors = tensors.dtype, tensors.tensors
        self.model, self.tensors, self.dtype, self.device = model, tensors, dtype, device
        self.blocks = blocks_of(model)
        names = {block: name for name, block in model.named_modules()}
        self.prefixes = [names[block] + "." for block in self.blocks]
        # keys first: a value read from a cast view is cast
        rest = {k: tensors[k] for k in tensors if not k.startswith(tuple(self.prefixes))}
        self._assign(model, rest)
        for module in model.modules():  # the buffers it computes, in fp32 on the device as the in-memory path has them
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = (buffer.float() if buffer.is_floating_point() else buffer).to(device)

    def _assign(self, module: nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """``tensors`` (keys relative to ``module``) assigned into ``module``, fresh; parameters (a cast view's: what
        it casts) rounded to ``dtype``."""
        rounded = {k for k in tensors if prefix + k in self.rounded}
        for key, fresh in _fresh(tensors, rounded, self.dtype, self.device).items():
            owner, _, name = key.rpartition(".")
            holder = module.get_submodule(owner)
            built = holder._parameters.get(name)
            if built is not None:  # frozen as built: a frozen layer may take another kernel
                holder._parameters[name] = nn.Parameter(fresh, built.requires_grad)
            else:
                holder._buffers[name] = fresh

    def _load(self, i: int) -> None:
        prefix = self.prefixes[i]
        own = {k[len(prefix) :]: self.tensors[k] for k in self.tensors if k.startswith(prefix)}
        self._assign(self.blocks[i], own, prefix)

    def _free(self, i: int) -> None:
        for module in self.blocks[i].modules():
            for name, param in module.named_parameters(recurse=False):
                module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)
        _trim()

    def run(
        self,
        batches: Sequence[torch.Tensor],
        forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        done: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """``forward(model, x)`` of every batch (moved to the device), as fp32 on the CPU, the batches in lockstep;
        ``done(i)`` after block ``i`` ran for all of them.

        Raises:
            RuntimeError: The batches reached different blocks (a forward whose path depends on its input).
        """
        return _Lockstep(self, batches, forward, done).run()


class _Worker(threading.Thread):
    """One batch's forward pass, run only while the lockstep lets it: it waits at every block's start."""

    def __init__(self, step: _Lockstep, x: torch.Tensor) -> None:
        super().__init__(daemon=True)
        self.step, self.x = step, x
        self.go = threading.Event()
        self.at: int | None = None
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.finished = False

    def pause(self, block: int) -> None:
        self.at = block
        self.step.back.set()
        self.go.wait()
        self.go.clear()
        if self.step.cancelled:
            raise RuntimeError("verification stopped")

    def run(self) -> None:
        self.step.local.worker = self
        self.go.wait()
        self.go.clear()
        try:
            with torch.no_grad():
                s = self.step
                self.out = s.forward(s.streamed.model, self.x.to(s.streamed.device)).float().cpu()
        except BaseException as e:  # handed to the thread that runs the lockstep
            self.error = e
        self.finished = True
        self.step.back.set()


class _Lockstep:
    """The threads of one input group's batches, resumed one at a time until each reaches the next block."""

    def __init__(
        self,
        streamed: StreamedModel,
        batches: Sequence[torch.Tensor],
        forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        done: Callable[[int], None] | None,
    ) -> None:
        self.streamed, self.forward, self.done = streamed, forward, done
        self.back, self.local, self.cancelled = threading.Event(), threading.local(), False
        self.index = {id(block): i for i, block in enumerate(streamed.blocks)}
        self.workers = [_Worker(self, x) for x in batches]

    def _hook(self, module: nn.Module, args: Any) -> None:
        self.local.worker.pause(self.index[id(module)])

    def _resume_all(self) -> set[int]:
        for w in self.workers:
            if not w.finished:
                w.go.set()
                self.back.wait()
                self.back.clear()
                if w.error is not None:
                    raise w.error
        return {w.at for w in self.workers if not w.finished and w.at is not None}

    def run(self) -> list[torch.Tensor]:
        s = self.streamed
        hooks = [block.register_forward_pre_hook(self._hook) for block in s.blocks]
        loaded: int | None = None
        try:
            for w in self.workers:
                w.start()
            while True:
                at = self._resume_all()  # every batch waits at the next block, or has finished
                if len(at) > 1:
                    raise RuntimeError(f"the batches reached different blocks {sorted(at)}; verify in memory")
                if loaded is not None:
                    s._free(loaded)
                    if self.done:
                        self.done(loaded)
                if not at:
                    break
                loaded = at.pop()
                s._load(loaded)
        finally:
            for h in hooks:
                h.remove()
            self.cancelled = True  # a failed lockstep lets the others end at their next block
            for w in self.workers:
                w.go.set()
        return [w.out for w in self.workers if w.out is not None]


def build_streamed(
    build: Callable[[], nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    name: str,
    filter_fn: Callable[[dict[str, torch.Tensor], nn.Module], Mapping[str, torch.Tensor]] | None,
    dtype: torch.dtype | None,
    device: torch.device,
) -> StreamedModel:
    """``build()`` with its parameters on the meta device, ``state_dict`` through ``filter_fn`` checked strictly
    against it (every missing, unexpected and mis-shaped key listed), and the weights outside its blocks loaded.

    Raises:
        RemapError: The state dict does not fit the model.
    """
    with parameters_on_meta():
        model = build()
    if filter_fn is not None:
        state_dict = _filtered(filter_fn, state_dict, model)
    check_state_dict(state_dict, model.state_dict(), name)
    return StreamedModel(model.eval(), state_dict, dtype, device)


def _filtered(
    filter_fn: Callable[[dict[str, torch.Tensor], nn.Module], Mapping[str, torch.Tensor]],
    state_dict: Mapping[str, torch.Tensor],
    model: nn.Module,
) -> Mapping[str, torch.Tensor]:
    """``state_dict`` through ``filter_fn``, a cast view (:func:`~timm_layerscale.conversion.rules.cast_tensors`)
    uncast, its outputs then cast as they are read but those that are the tensors it kept: the filters rename, slice
    and join tensors, which a cast commutes with, and a cast of the whole dict would hold a model's worth of copies."""
    if not isinstance(state_dict, Cast):
        return filter_fn(dict(state_dict), model)
    kept = {state_dict.tensors[k].data_ptr() for k in state_dict.keep if k in state_dict.tensors}
    out = filter_fn(dict(state_dict.tensors), model)
    return cast_tensors(out, state_dict.dtype, {k for k, v in out.items() if v.data_ptr() in kept})
