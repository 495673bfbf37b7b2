"""The models that read a state dict in its own layout as that layout's code loads it (each family's ``native``
loaders), so that no key rule of this package stands between a file and the model that reads it; built on fresh
fp32 memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..conversion.detect import timm_args
from ..conversion.rules import check_state_dict
from ..families import Layout, Variant
from .stream import StreamedModel, build_streamed

__all__ = ["build_loaded", "build_reference", "load_model", "model_name", "stream_model", "unused_by"]

Filter = Callable[[dict[str, torch.Tensor], nn.Module], Mapping[str, torch.Tensor]]


def model_name(variant: Variant, layout: Layout) -> str:
    """The name the model reading ``layout`` is reported by (``cait_s24_224``, ``cait_s24_224_ls``,
    ``vit5_official/vit5_base_patch16_224``, ``transformers/vit_small_patch16_dinov3``)."""
    if layout.library:
        return f"{layout.name}/{variant.reference or variant.name}"
    if layout is variant.family.layouts["ls"]:
        return variant.name
    return variant.reference or f"{variant.family.name}_{layout.name}/{variant.name}"


def build_loaded(
    build: Callable[[], nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    name: str,
    filter_fn: Filter | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """``build()`` with ``state_dict`` (through ``filter_fn(state_dict, model)``, as timm's loader passes it) loaded
    strictly, its parameters rounded once to ``dtype`` (a written file's; buffers kept), then every floating-point
    tensor as fp32, in eval mode: built on the meta device and assigned fresh copies, or (computing buffers its state
    dict lacks) built for real and copied into, so never on tensors mapped from a file, whose alignment (a BLAS may
    sum a GEMM on a weight at 8 mod 16 bytes in another order) would sway the verdict.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys, all listed.
    """
    with torch.device("meta"):
        model = build()
    if filter_fn is not None:
        state_dict = filter_fn(dict(state_dict), model)
    on_meta = {k for k, _ in model.named_buffers()} <= model.state_dict().keys()
    if not on_meta:
        model = build()
    check_state_dict(state_dict, model.state_dict(), name)
    params = {k for k, _ in model.named_parameters()}
    fresh = {}
    for k, v in state_dict.items():
        v = v.to(dtype) if dtype is not None and k in params and v.is_floating_point() else v
        fresh[k] = torch.empty(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype).copy_(v)
    model.load_state_dict(fresh, strict=True, assign=on_meta)
    return model.float().eval()


def load_model(
    variant: Variant,
    layout: Layout,
    state_dict: Mapping[str, torch.Tensor],
    *,
    folded: bool = False,
    dtype: torch.dtype | None = None,
    **args: Any,
) -> nn.Module:
    """The model that reads ``state_dict`` (prefix-free, in ``layout``; ``folded``: without gates) as the layout's
    consumer loads it, strictly, its parameters rounded to ``dtype``, in fp32 and eval mode; ``args``: ``num_classes`` and ``img_size`` beyond the variant's, a transformers
    folder's ``config``.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys, all listed.
    """
    assert layout.native is not None
    name = model_name(variant, layout)
    build, filter_fn = layout.native(variant, folded, timm_args(args))
    return build_loaded(build, state_dict, name, filter_fn, dtype)


def stream_model(
    variant: Variant,
    layout: Layout,
    state_dict: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    folded: bool = False,
    dtype: torch.dtype | None = None,
    **args: Any,
) -> StreamedModel:
    """:func:`load_model`'s model with its blocks' weights left in ``state_dict`` until each block runs
    (:class:`~.stream.StreamedModel`), on ``device``.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys, all listed.
    """
    assert layout.native is not None
    name = model_name(variant, layout)
    build, filter_fn = layout.native(variant, folded, timm_args(args))
    return build_streamed(build, state_dict, name, filter_fn, dtype, device)


def build_reference(variant: Variant, **args: Any) -> nn.Module:
    """The model of the layout ``gamma`` names for a ``.pth`` file of ``variant`` with random weights, in train mode
    (timm's ``cait_*``, ``deit3_*`` and DINO models, the official-layout ViT-5), for writing official-layout files."""
    native = variant.family.layouts[variant.family.alias("pth")].native
    assert native is not None
    return native(variant, False, timm_args(args))[0]()


def unused_by(variant: Variant, layout: Layout, tensors: Mapping[str, torch.Tensor], **args: Any) -> list[str]:
    """The tensors (or parts: ``"blocks.0.attn.qkv.bias (part)"``) of a state dict in ``layout`` that the loader native
    to it leaves unused, its filter run on the model built on the meta device: those no output tensor holds a view
    of, where filling them (or the part) with NaN changes no output either (a value merged into another tensor is
    used). Nothing of the model runs."""
    assert layout.native is not None
    build, filter_fn = layout.native(variant, False, timm_args(args))
    with torch.device("meta"):
        model = build()
    outputs = list(filter_fn(dict(tensors), model).values())
    unused = []
    for key, tensor in tensors.items():
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        held = torch.zeros(tensor.numel(), dtype=torch.bool)
        for out in outputs:
            lo, hi = max(start, out.data_ptr()), min(end, out.data_ptr() + out.nbytes)
            if lo < hi and out.is_contiguous():
                held[(lo - start) // tensor.element_size() : (hi - start) // tensor.element_size()] = True
        if held.all():
            continue
        if tensor.is_floating_point():  # merged into a tensor the filter computes, perhaps
            probe = tensor.detach().clone().reshape(-1)
            probe[~held] = float("nan")
            probed = filter_fn({**tensors, key: probe.reshape(tensor.shape)}, model).values()
            if any(t.is_floating_point() and bool(t.isnan().any()) for t in probed):
                continue
        unused.append(key if not held.any() else f"{key} (part)")
    return unused
