"""Verification of a conversion's outputs: the reference reads the source's own tensors, the converted model the
converted ones, each through the loader native to its layout (:mod:`.references`), and both run on the same inputs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, cast

import torch

from .. import progress
from ..conversion.detect import Detection
from ..errors import CheckpointError, option
from ..families import Layout, state_dict_shapes
from .compare import ParityReport, compare_models
from .inputs import image_inputs, seeded_inputs
from .references import load_model, model_name
from .tolerance import Tolerance, VerifyOptions, resolve_tolerance

__all__ = ["verify_outputs"]


def _check_memory(name: str, numel: int) -> None:
    """A one-line :class:`~timm_layerscale.errors.CheckpointError` where the two fp32 models of a check (``numel``
    parameters each) need more memory than Linux says is available; elsewhere nothing is checked."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    needed = 2 * 4 * numel
    if needed > available:
        raise CheckpointError(
            f"verifying {name} needs about {needed / 2**30:.0f} GiB for two fp32 copies and "
            f"{available / 2**30:.0f} GiB is available; verify on a larger machine, or pass {option('no_verify')}"
        )


def _epsilon_shift(ref: torch.nn.Module, batches: list[torch.Tensor], forward: Any, eps: float, ours: float) -> float:
    """The largest change of the reference's outputs on ``batches`` when its LayerNorms of epsilon ``eps`` (a
    transformers folder's ``layer_norm_eps``) compute with ``ours`` (the converted model's) instead: the part of the
    difference the epsilons make, measured, so that a bound can cover it."""
    norms = [m for m in ref.modules() if isinstance(m, torch.nn.LayerNorm) and m.eps == eps]
    device = next(ref.parameters()).device
    outputs = []
    for value in (ours, eps):  # the folder's own epsilon restored last
        for m in norms:
            m.eps = value
        with torch.no_grad():
            outputs.append([forward(ref.eval(), x.to(device)).float().cpu() for x in batches])
    return max(float((a - b).abs().max()) for a, b in zip(*outputs, strict=True))


def verify_outputs(
    source: Detection,
    source_tensors: Mapping[str, torch.Tensor],
    converted: Mapping[str, torch.Tensor],
    layout: Layout,
    *,
    dtype: torch.dtype | None = None,
    folded: bool = False,
    options: VerifyOptions | None = None,
    args: Mapping[str, Any] | None = None,
) -> ParityReport:
    """The parity report of the reference on ``source_tensors`` (the detected ``source``'s own, read by its layout's
    consumer, its parameters then rounded to ``dtype``, the converted file's; ``None``: the source's) against the
    model on ``converted`` (in ``layout``, ``folded`` or not), in fp32. ``args``: the reference's model arguments
    (the detection's overrides, a transformers folder's own ``config``). The report's weight fields are the caller's.

    Raises:
        RemapError: The converted tensors do not fit the model of their layout (the keys listed).
        CheckpointError: No CUDA device for ``device='cuda'``, or image files of another size.
    """
    options = options or VerifyOptions()
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(
            f"device {options.device!r}: no CUDA device is available here; pass {option('device', 'cpu')}"
        )
    variant, family, overrides = source.variant, source.variant.family, source.overrides
    names = model_name(variant, source.layout), model_name(variant, layout) + (" (folded_layerscale)" if folded else "")
    _check_memory(variant.name, sum(t.numel() for t in source_tensors.values()))
    t0 = time.perf_counter()
    ref = load_model(variant, source.layout, source_tensors, dtype=dtype, **(args or overrides))
    t1 = time.perf_counter()
    out = load_model(variant, layout, converted, folded=folded, **cast(dict[str, Any], overrides))
    loading = {"reference": t1 - t0, "converted model": time.perf_counter() - t1}
    if not any(getattr(m, "fused_attn", False) for m in ref.modules()):  # a reference that attends by hand
        for m in out.modules():
            if hasattr(m, "fused_attn"):
                setattr(m, "fused_attn", False)  # noqa: B010  (a Module attribute mypy sees as Tensor | Module)
    device = torch.device(options.device)
    ref.to(device)
    out.to(device)
    size = tuple(getattr(out, "pretrained_cfg", {}).get("input_size", (3, variant.img_size, variant.img_size))[-2:])
    inputs = seeded_inputs(options.num_inputs, size, options.seed)
    parts = [f"{options.num_inputs} seeded N(0,1) images (seed {options.seed})"] if options.num_inputs else []
    if options.images:
        files = image_inputs(options.images, out)
        if files.shape[-2:] != inputs.shape[-2:]:
            raise CheckpointError("image files resolve to another input size than the model's; check the image files")
        inputs = torch.cat([inputs, files])
        parts.append(f"{len(options.images)} image file(s)")
    groups, at = [inputs], f" at {size[0]}x{size[1]}"
    if options.num_inputs and all(getattr(m, "dynamic_img_size", False) for m in (ref, out)):
        # models that take any input size are checked at a second, non-square one too (their positions resampled)
        wide = (size[0], max(variant.patch_size, size[1] * 3 // 4 // variant.patch_size * variant.patch_size))
        groups.append(seeded_inputs(options.num_inputs, wide, options.seed + 1))
        at += f", {options.num_inputs} more (seed {options.seed + 1}) at {wide[0]}x{wide[1]}"
    tokens, independent = family.tokens, source.layout.library or layout.library
    weights = dtype or next((v.dtype for v in converted.values() if v.is_floating_point()), torch.float32)
    forward = (lambda m, x: cast(Any, m).forward_features(x)) if tokens else (lambda m, x: m(x))
    tolerance = resolve_tolerance(variant, weights, options, folded=folded, independent=independent)
    eps, config = getattr((args or {}).get("config"), "layer_norm_eps", None), source.layout.config
    ours = config(variant, state_dict_shapes(variant, 0)).layer_norm_eps if eps is not None and config else None
    if eps is not None and ours is not None and eps != ours:  # a folder's other epsilon (transformers' 1e-12)
        shift = _epsilon_shift(ref, [x for g in groups for x in g.split(options.batch_size)], forward, eps, ours)
        why = f"; the folder's layer_norm_eps {eps:g}, the model's {ours:g}: twice their measured {shift:.3g} added"
        tolerance = Tolerance(tolerance.atol + 2 * shift, tolerance.rtol, tolerance.reason + why)
    report = compare_models(
        ref,
        out,
        groups,
        reference_name=names[0],
        model_name=names[1],
        family=family.name,
        inputs_desc=" + ".join(parts) + at + (", forward_features tokens" if tokens else ""),
        batch_size=options.batch_size,
        weights_dtype=str(weights).removeprefix("torch."),
        tolerance=tolerance,
        forward=forward,
        progress=lambda batches: progress.bar(list(batches), desc="verifying", unit="batch"),
    )
    report.seconds = {k: round(v + loading[k], 3) for k, v in report.seconds.items()}
    return report
