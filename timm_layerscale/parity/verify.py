"""Verification of a conversion: the converted model against the reference on the same inputs, and the
converted weights against the source's tensor by tensor."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import progress
from ..conversion.detect import Detection, timm_args
from ..conversion.fold import fold_state_dict
from ..conversion.keys import to_layerscale
from ..errors import CheckpointError, option
from ..families import GATE_KEY
from .compare import ParityReport, compare_models, compare_weights
from .inputs import image_inputs, seeded_inputs
from .references import build_loaded, build_reference, reference_name
from .tolerance import VerifyOptions, resolve_tolerance

__all__ = ["verify_state_dicts"]


def verify_state_dicts(
    source: Detection,
    converted: Mapping[str, torch.Tensor],
    *,
    options: VerifyOptions | None = None,
    folded: bool | None = None,
) -> ParityReport:
    """Compare the reference on the source's weights with the model on the converted ones.

    Args:
        source: The detected source (its variant, arguments and ``ls``-layout tensors).
        converted: The converted weights in any layout; their float dtype is the check's.
        options: Tolerances, inputs and device.
        folded: The converted weights have LayerScale folded in; default: they have no gates
            where the source has.

    Raises:
        RemapError: The converted weights do not fit the model.
        CheckpointError: No CUDA device for ``device='cuda'``, or image files of another size.
    """
    import timm

    options = options or VerifyOptions()
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(
            f"device {options.device!r}: no CUDA device is available here; pass {option('device', 'cpu')}"
        )
    variant, args = source.variant, source.model_args
    conv = to_layerscale(converted, variant.family)
    if folded is None:
        folded = any(map(GATE_KEY.fullmatch, source.state_dict)) and not any(map(GATE_KEY.fullmatch, conv))
    expected = fold_state_dict(source.state_dict) if folded else source.state_dict
    cast = {k: v.to(conv[k].dtype) if k in conv and v.is_floating_point() else v for k, v in expected.items()}
    dtype = next((v.dtype for v in conv.values() if v.is_floating_point()), torch.float32)
    ref = build_reference(variant, source.state_dict, **args)
    build_args = timm_args({**args, **({"folded_layerscale": True} if folded else {})})
    out = build_loaded(lambda: timm.create_model(variant.name, **build_args), conv, variant.name)
    if not any(getattr(m, "fused_attn", False) for m in ref.modules()):  # a reference that attends by hand
        for m in out.modules():
            if hasattr(m, "fused_attn"):
                setattr(m, "fused_attn", False)  # noqa: B010  (a Module attribute mypy sees as Tensor | Module)
    device = torch.device(options.device)
    ref.to(device, dtype)
    out.to(device, dtype)
    size = tuple(getattr(out, "pretrained_cfg", {}).get("input_size", (3, variant.img_size, variant.img_size))[-2:])
    inputs = seeded_inputs(options.num_inputs, size, options.seed)
    parts = [f"{options.num_inputs} seeded N(0,1) images (seed {options.seed})"] if options.num_inputs else []
    if options.images:
        files = image_inputs(options.images, out)
        if files.shape[-2:] != inputs.shape[-2:]:
            raise CheckpointError("image files resolve to another input size than the model's; check the image files")
        inputs = torch.cat([inputs, files])
        parts.append(f"{len(options.images)} image file(s)")
    return compare_models(
        ref,
        out,
        inputs,
        reference_name=reference_name(variant),
        model_name=f"{variant.name} (folded_layerscale)" if folded else variant.name,
        family=variant.family,
        inputs_desc=" + ".join(parts) + f" at {'x'.join(map(str, size))}",
        batch_size=options.batch_size,
        tolerance=resolve_tolerance(variant.family, dtype, options, folded=folded),
        weights=compare_weights(cast, conv),
        progress=lambda batches: progress.bar(list(batches), desc="verifying", unit="batch"),
    )
