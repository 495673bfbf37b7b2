"""Parity references: models that compute the released function from the original weights.

A converted checkpoint is trusted because the package's model, loaded with it, gives
the outputs of a *reference* loaded with the original file. Per family:

- ``cait``: timm's ``cait_*`` (same math and key names as the official code), with its
  class attention on the manual (non-SDPA) path, which matches the official model bit
  for bit.
- ``deit3``: timm's ``deit3_*``, loaded the way timm itself loads an official
  ``deit_3_*.pth`` file: its ``checkpoint_filter_fn(adapt_layer_scale=True)``.
- ``vit5``: timm has no ViT-5; the reference is :mod:`.vit5_official`, an independent
  plain-PyTorch implementation in the official key layout.

Interface: :func:`build_reference` gives the un-initialised reference,
:func:`reference_state_dict` turns a source state dict into what it loads strictly,
:func:`load_reference` does both.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..conversion.keys import strip_prefixes, to_gamma, to_layerscale, unwrap_state_dict
from . import vit5_official

__all__ = ["build_reference", "reference_state_dict", "load_reference", "reference_name", "FAMILIES"]

#: Families with a reference.
FAMILIES = ("cait", "deit3", "vit5")


def _base(name: str) -> str:
    return name.split(".", 1)[0]


def _timm_name(variant_name: str, family: str) -> str:
    base = _base(variant_name)
    if family == "cait":
        from ..models import cait_ls

        return cait_ls.REFERENCE.get(base, base[: -len("_ls")] if base.endswith("_ls") else base)
    return base


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise KeyError(f"no parity reference for family {family!r}; choose one of: {', '.join(FAMILIES)}")


def reference_name(variant_name: str, family: str) -> str:
    """The name a reference is reported by (``deit3_small_patch16_224``, ``vit5_official/vit5_base_patch16_224``)."""
    _check_family(family)
    if family == "vit5":
        return f"vit5_official/{_base(variant_name)}"
    return _timm_name(variant_name, family)


def build_reference(variant_name: str, family: str, num_classes: int | None = None) -> nn.Module:
    """The reference model of a variant, with random weights, in train mode.

    Args:
        variant_name: This package's name (``cait_s24_224_ls``) or timm's
            (``deit3_small_patch16_224``); a pretrained tag is ignored.
        family: ``"cait"``, ``"deit3"`` or ``"vit5"``.
        num_classes: Classifier outputs when they differ from the default 1000.

    Returns:
        A model for ``load_state_dict(reference_state_dict(...), strict=True)``.
    """
    _check_family(family)
    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if family == "vit5":
        return vit5_official.build_reference(variant_name, **kwargs)
    import timm

    model = timm.create_model(_timm_name(variant_name, family), **kwargs)
    if family == "cait":
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
    return model


def reference_state_dict(
    variant_name: str, family: str, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A source state dict as the reference loads it.

    Args:
        variant_name: As for :func:`build_reference`.
        family: ``"cait"``, ``"deit3"`` or ``"vit5"``.
        state_dict: The original weights (a training dict or prefixed keys are fine),
            or weights in this package's ``ls`` layout.

    Returns:
        ``cait``: the official ``gamma`` layout. ``deit3``: the output of timm's own
        DeiT-III checkpoint filter. ``vit5``: the official layout, the source's
        ``*.freqs`` buffers kept, absent ones filled from the reference's own.
    """
    _check_family(family)
    sd = strip_prefixes(unwrap_state_dict(state_dict))
    if family == "cait":
        return to_gamma(to_layerscale(sd, "cait"), "cait")
    if family == "deit3":
        import timm
        from timm.models.vision_transformer import checkpoint_filter_fn

        with torch.device("meta"):
            target = timm.create_model(_timm_name(variant_name, family))
        return checkpoint_filter_fn(dict(sd), target, adapt_layer_scale=True)
    out = vit5_official.rope_buffers(variant_name)
    out.update(to_gamma(to_layerscale(sd, "vit5"), "vit5"))
    out.update({k: v for k, v in sd.items() if k.endswith(".freqs")})
    return out


def load_reference(
    variant: Any, state_dict: Mapping[str, torch.Tensor], num_classes: int | None = None
) -> tuple[nn.Module, str]:
    """Build a variant's reference and load the original weights strictly.

    Args:
        variant: A :class:`timm_layerscale.conversion.detect.Variant` (``name`` and ``family``).
        state_dict: The original weights.
        num_classes: Classifier outputs when they differ from the default.

    Returns:
        ``(model, name)``: the reference in eval mode and the name it is reported by.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys.
    """
    from ..conversion.keys import check_state_dict

    name = reference_name(variant.name, variant.family)
    model = build_reference(variant.name, variant.family, num_classes)
    sd = reference_state_dict(variant.name, variant.family, state_dict)
    check_state_dict(sd, model.state_dict(), name)
    model.load_state_dict(sd, strict=True)
    return model.eval(), name
