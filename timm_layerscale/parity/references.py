"""Parity references: the models that compute the released function from the original weights.

``cait``: timm's ``cait_*`` (the official math and keys). ``deit3``: timm's ``deit3_*``, loaded
through its own ``checkpoint_filter_fn(adapt_layer_scale=True)`` as timm loads an official file.
``vit5``: :mod:`.vit5_official`, an independent implementation in the official key layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from ..conversion.detect import timm_args
from ..conversion.keys import check_state_dict, to_gamma
from ..families import Variant, get_variant, official_rope_buffers
from .vit5_official import build_official_vit5

__all__ = ["build_loaded", "build_reference", "reference_name"]


def reference_name(variant: Variant) -> str:
    """The name a reference is reported by (``cait_s24_224``, ``vit5_official/vit5_base_patch16_224``)."""
    return variant.reference or f"{variant.family}_official/{variant.name}"


def build_loaded(build: Callable[[], nn.Module], state_dict: Mapping[str, torch.Tensor], name: str) -> nn.Module:
    """``build()`` with ``state_dict`` loaded strictly, in eval mode.

    The model is built on the meta device and assigned fresh copies of the tensors, unless it
    computes buffers its state dict lacks; then it is built for real and the tensors copied in.
    Either way it computes on fresh allocations, never on tensors mapped from a file, whose
    alignment (a BLAS may sum a GEMM on a weight at 8 mod 16 bytes in another order) would make
    the verdict depend on the file's layout.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys, all listed.
    """
    with torch.device("meta"):
        model = build()
    on_meta = {k for k, _ in model.named_buffers()} <= model.state_dict().keys()
    if not on_meta:
        model = build()
    check_state_dict(state_dict, model.state_dict(), name)
    if on_meta:
        state_dict = {k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=on_meta)
    return model.eval()


def build_reference(
    variant: Variant | str, state_dict: Mapping[str, torch.Tensor] | None = None, **model_args: Any
) -> nn.Module:
    """The reference of ``variant``: random weights (train mode), or ``state_dict`` (``ls`` layout,
    mapped to the official one) loaded strictly (eval mode).

    Args:
        variant: The variant (or its name).
        state_dict: The weights in the ``ls`` layout, or ``None``.
        **model_args: ``num_classes``, ``img_size`` beyond the variant's.
    """
    variant = get_variant(variant) if isinstance(variant, str) else variant

    def build() -> nn.Module:
        if variant.family == "vit5":
            return build_official_vit5(variant, **model_args)
        import timm

        return timm.create_model(str(variant.reference), **timm_args(model_args))

    if state_dict is None:
        return build()
    if variant.family == "deit3":  # timm's deit3 keys are the ls layout
        from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

        with torch.device("meta"):
            target = build()
        sd = checkpoint_filter_fn(dict(state_dict), cast(VisionTransformer, target), adapt_layer_scale=True)
    else:
        sd = to_gamma(state_dict, variant.family)
        if variant.family == "vit5":  # the official model keeps its rotary tables as buffers
            sd.update(official_rope_buffers(variant))
    return build_loaded(build, sd, reference_name(variant))
