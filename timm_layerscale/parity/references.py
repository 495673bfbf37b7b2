"""Parity references: models that compute the released function from the original weights.

A converted checkpoint is trusted because the package's model, loaded with it, gives
the outputs of a *reference* loaded with the original file. Per family:

- ``cait``: timm's ``cait_*`` (same math and key names as the official code), built as
  timm builds it; the converted model is built the same way, so both take timm's
  attention path (fused or not, ``TIMM_FUSED_ATTN``) and run the same kernels.
- ``deit3``: timm's ``deit3_*``, loaded the way timm itself loads an official
  ``deit_3_*.pth`` file: its ``checkpoint_filter_fn(adapt_layer_scale=True)``.
- ``vit5``: timm has no ViT-5; the reference is :mod:`.vit5_official`, an independent
  plain-PyTorch implementation in the official key layout.

:func:`build_reference` is the one way to get a reference: random weights, or the
original weights loaded strictly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..conversion.detect import get_variant, timm_args
from ..conversion.keys import check_state_dict, state_dict_of, to_gamma, to_layerscale
from ..families import Variant, official_rope_buffers
from .vit5_official import build_official_vit5

__all__ = ["build_reference", "build_loaded", "reference_state_dict", "reference_name"]


class _SkipInit(TorchFunctionMode):
    """Skips the initialisers of meta tensors, which write values that such a tensor does not hold:
    torch runs some of them there (``clamp_`` of a truncated normal) through Python reference
    kernels, 0.5 s of a timm ``cait_xxs24_224`` built on meta. ``torch.nn.init``'s functions come
    with their tensor as a keyword."""

    SKIPPED = frozenset(
        {"uniform_", "normal_", "trunc_normal_", "erfinv_", "mul_", "add_", "clamp_", "fill_", "zero_", "copy_"}
        | {"constant_", "zeros_", "ones_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"}
    )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", "") in self.SKIPPED and getattr(target, "is_meta", False):
            return target
        return func(*args, **kwargs)


def _variant(variant: Variant | str) -> Variant:
    return variant if isinstance(variant, Variant) else get_variant(variant)


def reference_name(variant: Variant | str) -> str:
    """The name a reference is reported by (``cait_s24_224``, ``vit5_official/vit5_base_patch16_224``)."""
    v = _variant(variant)
    return v.reference if v.reference is not None else f"{v.family}_official/{v.name}"


def reference_state_dict(
    variant: Variant | str, state_dict: Mapping[str, Any], **model_args: Any
) -> dict[str, torch.Tensor]:
    """A source state dict as the reference loads it.

    Args:
        variant: The variant (or its name).
        state_dict: The original weights (a training dict or prefixed keys are fine),
            or weights in this package's ``ls`` layout.
        **model_args: The model's arguments beyond its variant's (``img_size``: timm's DeiT-III
            filter resamples the position embedding to the model's grid).

    Returns:
        ``cait``: the official ``gamma`` layout. ``deit3``: the output of timm's own
        DeiT-III checkpoint filter. ``vit5``: the official layout, the source's
        ``*.freqs`` buffers kept, absent ones computed.
    """
    v = _variant(variant)
    sd = state_dict_of(state_dict)
    if v.family == "deit3":
        import timm
        from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

        with torch.device("meta"), _SkipInit():
            target = timm.create_model(v.name, **model_args)
        return checkpoint_filter_fn(dict(sd), cast(VisionTransformer, target), adapt_layer_scale=True)
    out: dict[str, torch.Tensor] = official_rope_buffers(v) if v.family == "vit5" else {}
    out.update(to_gamma(to_layerscale(sd, v.family), v.family))
    out.update({k: t for k, t in sd.items() if k.endswith(".freqs")})
    return out


def build_loaded(build: Callable[[], nn.Module], state_dict: Mapping[str, torch.Tensor], name: str) -> nn.Module:
    """Build a model with ``build()`` and load ``state_dict`` into it strictly; eval mode.

    The model is built on the meta device, skipping its random initialisation (several
    seconds for a large model), and takes fresh copies of the tensors
    (``load_state_dict(assign=True)``). A model with computed buffers that its state dict
    does not hold is built for real instead, and the tensors are copied into it.

    Args:
        build: Makes the model.
        state_dict: Its exact keys and shapes.
        name: The model's name in the error message.

    Either way the model computes on fresh allocations, as ``timm.create_model(...,
    pretrained=True)`` gives a user, never on tensors mapped from a file: a tensor
    mapped from a safetensors file starts wherever the file's header ends (8-byte
    steps), and a BLAS may sum a GEMM on a weight that is not 16-byte aligned in
    another order, so the verdict would depend on the length of the file's metadata.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys (all listed in one message).
    """
    with torch.device("meta"), _SkipInit():
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
    variant: Variant | str, state_dict: Mapping[str, Any] | None = None, **model_args: Any
) -> nn.Module:
    """The reference model of a variant.

    Args:
        variant: The variant (or its name; a pretrained tag is ignored).
        state_dict: The original weights, loaded strictly (:func:`reference_state_dict`);
            ``None`` leaves the reference's random initialisation.
        **model_args: The model's arguments beyond its variant's: ``num_classes`` (classifier
            outputs, default 1000), ``img_size`` (another resolution).

    Returns:
        The reference, in eval mode when weights were loaded, else in train mode.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys (all listed in one message).
    """
    v = _variant(variant)

    def build() -> nn.Module:
        if v.family == "vit5":
            return build_official_vit5(v, **model_args)
        import timm

        return timm.create_model(str(v.reference), **timm_args(model_args))

    if state_dict is None:
        return build()
    return build_loaded(build, reference_state_dict(v, state_dict, **model_args), reference_name(v))
