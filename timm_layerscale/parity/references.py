"""The models that read a state dict in its own layout as that layout's code loads it (each family's ``native``
loaders), so that no key rule of this package stands between a file and the model that reads it; built on fresh
fp32 memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..conversion.detect import timm_args
from ..conversion.keys import check_state_dict
from ..families import Variant, get_family, get_variant

__all__ = ["build_loaded", "build_reference", "load_model", "model_name"]

Filter = Callable[[dict[str, torch.Tensor], nn.Module], Mapping[str, torch.Tensor]]


def model_name(variant: Variant, layout: str) -> str:
    """The name the model reading ``layout`` is reported by (``cait_s24_224``, ``cait_s24_224_ls``,
    ``vit5_official/vit5_base_patch16_224``, ``transformers/vit_small_patch16_dinov3``)."""
    if layout in get_family(variant.family).independent:
        return f"{layout}/{variant.reference or variant.name}"
    if layout == "ls" or variant.reference == variant.name:  # timm's own model reads both layouts
        return variant.name
    return variant.reference or f"{variant.family}_official/{variant.name}"


def build_loaded(
    build: Callable[[], nn.Module], state_dict: Mapping[str, torch.Tensor], name: str, filter_fn: Filter | None = None
) -> nn.Module:
    """``build()`` with ``state_dict`` (through ``filter_fn(state_dict, model)``, as timm's loader passes it) loaded
    strictly, floating-point tensors as fp32, in eval mode: built on the meta device and assigned fresh copies, or
    (computing buffers its state dict lacks) built for real and copied into, so never on tensors mapped from a file,
    whose alignment (a BLAS may sum a GEMM on a weight at 8 mod 16 bytes in another order) would sway the verdict.

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
    fp32 = {k: torch.float32 if v.is_floating_point() else v.dtype for k, v in state_dict.items()}
    fresh = {k: torch.empty(v.shape, dtype=fp32[k]).copy_(v) for k, v in state_dict.items()}
    model.load_state_dict(fresh, strict=True, assign=on_meta)
    return model.float().eval()


def load_model(
    variant: Variant | str,
    layout: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    folded: bool = False,
    **model_args: Any,
) -> nn.Module:
    """The model that reads ``state_dict`` (prefix-free, in ``layout``: ``"gamma"`` or ``"ls"``; ``folded``: without
    gates) as the layout's own code loads it, strictly, in fp32 and eval mode; ``model_args``: ``num_classes`` and
    ``img_size`` beyond the variant's.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys, all listed.
    """
    variant = get_variant(variant) if isinstance(variant, str) else variant
    build, filter_fn = get_family(variant.family).native(variant, layout, folded, timm_args(model_args))
    return build_loaded(build, state_dict, model_name(variant, layout), filter_fn)


def build_reference(variant: Variant | str, **model_args: Any) -> nn.Module:
    """The official-layout model of ``variant`` with random weights, in train mode (timm's ``cait_*`` and
    ``deit3_*``, the official-layout ViT-5), for writing official-layout files."""
    variant = get_variant(variant) if isinstance(variant, str) else variant
    return get_family(variant.family).native(variant, "gamma", False, timm_args(model_args))[0]()
