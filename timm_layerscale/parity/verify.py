"""Verification: the converted model against the reference, and the converted weights against the source.

:func:`verify_state_dicts` builds both models, runs them on the same inputs
(:func:`~timm_layerscale.parity.compare.compare_models`) and compares every converted
tensor with its source (:func:`~timm_layerscale.parity.compare.compare_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import progress
from ..conversion.detect import timm_args
from ..conversion.keys import to_layerscale
from ..errors import CheckpointError
from ..families import FAMILIES, GATE_KEY, Family, Variant
from .compare import ParityReport, compare_models, compare_weights
from .inputs import image_inputs, seeded_inputs
from .references import build_loaded, build_reference, reference_name
from .tolerance import VerifyOptions, resolve_tolerance

__all__ = ["verify_state_dicts", "build_converted", "align_attention"]


def build_converted(variant: Variant, state_dict: Mapping[str, torch.Tensor], **kwargs: Any) -> nn.Module:
    """Build the target model and load a state dict in any accepted layout, strictly.

    ``kwargs`` go to ``timm.create_model`` (``num_classes``, ``img_size``: see
    :func:`~timm_layerscale.conversion.detect.timm_args`).

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys (all listed in one message).
    """
    import timm

    sd = to_layerscale(state_dict, FAMILIES[variant.family])
    return build_loaded(lambda: timm.create_model(variant.name, **timm_args(kwargs)), sd, variant.name)


def align_attention(reference: nn.Module, model: nn.Module) -> None:
    """Make ``model`` take the reference's attention path.

    timm fuses attention into ``scaled_dot_product_attention`` where it can; a
    reference that computes attention by hand (the official-layout ViT-5) is matched
    by turning fusion off in the converted model, so both run the same arithmetic.
    """
    if not any(getattr(m, "fused_attn", False) for m in reference.modules()):
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                setattr(m, "fused_attn", False)  # noqa: B010  (a Module attribute mypy sees as Tensor | Module)


def _dtype_of(sd: Mapping[str, torch.Tensor]) -> torch.dtype:
    for v in sd.values():
        if v.is_floating_point():
            return v.dtype
    return torch.float32


def _has_layerscale(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(GATE_KEY.fullmatch(k) for k in sd)


def _expected_weights(
    src_sd: Mapping[str, torch.Tensor], conv_ls: Mapping[str, torch.Tensor], family: str | Family, folded: bool
) -> dict[str, torch.Tensor]:
    """The source's tensors as the converted ones must be: remapped, folded if ``folded``, cast to their dtypes."""
    from ..conversion.fold import fold_state_dict

    expected = to_layerscale(src_sd, family)
    if folded:
        expected = fold_state_dict(expected)
    out = {}
    for k, v in expected.items():
        want = conv_ls.get(k)
        out[k] = v.to(want.dtype) if want is not None and v.is_floating_point() else v
    return out


def _device(options: VerifyOptions) -> torch.device:
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(f"device {options.device!r}: no CUDA device is available here; pass device='cpu'")
    return torch.device(options.device)


def verify_state_dicts(
    src_sd: Mapping[str, torch.Tensor],
    conv_sd: Mapping[str, torch.Tensor],
    variant: Variant,
    *,
    model_args: Mapping[str, Any] | None = None,
    options: VerifyOptions | None = None,
    folded: bool | None = None,
) -> ParityReport:
    """Compare the reference on the original weights with the converted model, and the weights themselves.

    Args:
        src_sd: The original weights (unwrapped, prefixes stripped), any dtype.
        conv_sd: The converted weights, any layout; their float dtype is the check's.
        variant: The architecture.
        model_args: The models' arguments beyond the variant's (``num_classes`` for a
            fine-tuned head, ``img_size`` for another resolution:
            :func:`~timm_layerscale.conversion.detect.model_args`).
        options: Tolerances, inputs and device (:class:`~timm_layerscale.parity.tolerance.VerifyOptions`).
        folded: The converted weights have LayerScale folded in; default: detected
            (the source has gammas, the converted weights none).

    Returns:
        The :class:`~timm_layerscale.parity.compare.ParityReport`.
    """
    options = options or VerifyOptions()
    device = _device(options)
    family = FAMILIES[variant.family]
    if folded is None:
        folded = _has_layerscale(src_sd) and not _has_layerscale(conv_sd)
    conv_ls = to_layerscale(conv_sd, family)
    weights = compare_weights(_expected_weights(src_sd, conv_ls, family, folded), conv_ls)
    dtype = _dtype_of(conv_sd)
    tolerance = resolve_tolerance(variant.family, dtype, options, folded=folded)
    args = dict(model_args or {})
    ref, ref_name = build_reference(variant, src_sd, **args), reference_name(variant)
    out = build_converted(variant, conv_sd, **args, **({"folded_layerscale": True} if folded else {}))
    align_attention(ref, out)
    ref.to(device, dtype)
    out.to(device, dtype)
    img: int | tuple[int, ...] = variant.img_size
    cfg_size = getattr(out, "pretrained_cfg", {}).get("input_size")
    if cfg_size:
        img = tuple(cfg_size[-2:])
    inputs = seeded_inputs(options.num_inputs, img, options.seed)
    size = img if isinstance(img, int) else "x".join(map(str, img))
    parts = [f"{options.num_inputs} seeded N(0,1) images (seed {options.seed})"] if options.num_inputs else []
    if options.images:
        files = image_inputs(options.images, out)
        if files.shape[-2:] != inputs.shape[-2:]:
            raise CheckpointError("image files resolve to another input size than the model's; check the image files")
        inputs = torch.cat([inputs, files])
        parts.append(f"{len(options.images)} image file(s)")
    desc = " + ".join(parts) + f" at {size}"
    return compare_models(
        ref,
        out,
        inputs,
        reference_name=ref_name,
        model_name=f"{variant.name} (folded_layerscale)" if folded else variant.name,
        family=variant.family,
        inputs_desc=desc,
        batch_size=options.batch_size,
        tolerance=tolerance,
        weights=weights,
        progress=lambda batches: progress.bar(list(batches), desc="verifying", unit="batch"),
    )
