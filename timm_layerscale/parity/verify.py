"""Verification of a conversion's outputs: the reference reads the source's own tensors, the converted model the
converted ones, each through the loader native to its layout (:mod:`.references`), and both run on the same inputs."""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Mapping
from typing import Any, cast

import torch

from .. import progress
from ..conversion.detect import Detection
from ..errors import CheckpointError, option
from ..families import Layout, Variant, state_dict_shapes
from .compare import ParityReport, compare_models
from .inputs import image_inputs, seeded_inputs
from .references import load_model, model_name, stream_model
from .tolerance import Tolerance, VerifyOptions, resolve_tolerance

__all__ = ["verify_outputs"]


def _available() -> int | None:
    """The memory Linux says is available, in bytes; ``None`` elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _streams(variant: Variant, stream: bool | None) -> bool:
    """Whether a check of ``variant`` runs one block at a time: as ``stream`` asks, else where the in-memory path's two
    fp32 models would need more than half the available memory. A one-line
    :class:`~timm_layerscale.errors.CheckpointError` where the path taken does not fit: the in-memory path's two
    models, or one block at a time, both models' weights outside their blocks and one block of each."""
    blocks: dict[str, int] = {}
    for key, shape in state_dict_shapes(variant).items():
        block = re.match(rf"({variant.family.blocks})\.", key)
        name = block[1] if block else ""
        blocks[name] = blocks.get(name, 0) + 4 * math.prod(shape)
    rest = blocks.pop("", 0)
    available, whole = _available(), 2 * (rest + sum(blocks.values()))
    streamed = available is not None and whole > available / 2 if stream is None else stream
    needed = 2 * (rest + max(blocks.values(), default=0)) if streamed else whole
    if available is not None and needed > available:
        how = (
            "one block at a time"
            if streamed
            else f"in memory (two fp32 copies; {option('stream')} reads a block at a time)"
        )
        raise CheckpointError(
            f"verifying {variant.name} {how} needs about {needed / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is "
            f"available; verify on a larger machine, or pass {option('no_verify')}"
        )
    return streamed


def _epsilon_shift(ref: torch.nn.Module, batches: list[torch.Tensor], run: Any, eps: float, ours: float) -> float:
    """The largest change of the reference's outputs on ``batches`` when its LayerNorms of epsilon ``eps`` (a
    transformers folder's ``layer_norm_eps``) compute with ``ours`` (the converted model's) instead: the part of the
    difference the epsilons make, measured, so that a bound can cover it."""
    norms = [m for m in ref.modules() if isinstance(m, torch.nn.LayerNorm) and m.eps == eps]
    outputs = []
    for value in (ours, eps):  # the folder's own epsilon restored last
        for m in norms:
            m.eps = value
        outputs.append(run(ref, batches))
    return max(float((a - b).abs().max()) for a, b in zip(*outputs, strict=True))


def _inputs(
    options: VerifyOptions, variant: Variant, ref: torch.nn.Module, out: torch.nn.Module
) -> tuple[list[torch.Tensor], str]:
    """The check's input groups, one per input size, and their description: the seeded images and image files at
    the model's input size, and where both models take any size, as many seeded images at a non-square one."""
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
    return groups, " + ".join(parts) + at


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
    legacy: bool = False,
) -> ParityReport:
    """The parity report of the reference on ``source_tensors`` (the detected ``source``'s own, read by its layout's
    consumer, its parameters then rounded to ``dtype``, the converted file's; ``None``: the source's) against the
    model on ``converted`` (in ``layout``, ``folded`` or not), in fp32. ``args``: the reference's model arguments
    (the detection's overrides, a transformers folder's own ``config``). ``legacy``: the source tensors were read whole
    from a legacy ``.pth`` (the report says so where the models stream). The report's weight fields are the caller's.

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
    streamed = _streams(variant, options.stream)
    device = torch.device(options.device)
    load: Any = functools.partial(stream_model, device=device) if streamed else load_model
    t0 = time.perf_counter()
    loaded = [load(variant, source.layout, source_tensors, dtype=dtype, **(args or overrides))]
    t1 = time.perf_counter()
    loaded.append(load(variant, layout, converted, folded=folded, **cast(dict[str, Any], overrides)))
    loading = {"reference": t1 - t0, "converted model": time.perf_counter() - t1}
    ref, out = (m.model if streamed else m.to(device) for m in loaded)
    streams = {id(m.model): m for m in loaded} if streamed else {}

    def run(m: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:  # a group's fp32 CPU outputs
        if streams:
            images = sum(len(x) for x in batches)
            return streams[id(m)].run(batches, forward, lambda block: bar.update(images) if bar else None)
        with torch.no_grad():
            return [forward(m, x.to(device)).float().cpu() for x in batches]

    if not all(any(getattr(m, "fused_attn", False) for m in model.modules()) for model in (ref, out)):
        for m in (*ref.modules(), *out.modules()):  # one side attends by hand: so does the other
            if hasattr(m, "fused_attn"):
                setattr(m, "fused_attn", False)  # noqa: B010  (a Module attribute mypy sees as Tensor | Module)
    groups, described = _inputs(options, variant, ref, out)
    tokens, independent = family.tokens, source.layout.library or layout.library
    weights = dtype or next((v.dtype for v in converted.values() if v.is_floating_point()), torch.float32)
    forward = (lambda m, x: cast(Any, m).forward_features(x)) if tokens else (lambda m, x: m(x))
    tolerance = resolve_tolerance(variant, weights, options, folded=folded, independent=independent)
    eps, config = getattr((args or {}).get("config"), "layer_norm_eps", None), source.layout.config
    ours = config(variant, state_dict_shapes(variant, 0)).layer_norm_eps if eps is not None and config else None
    if eps is not None and ours is not None and eps != ours:  # a folder's other epsilon (transformers' 1e-12)
        shift = _epsilon_shift(ref, [x for g in groups for x in g.split(options.batch_size)], run, eps, ours)
        why = f"; the folder's layer_norm_eps {eps:g}, the model's {ours:g}: twice their measured {shift:.3g} added"
        tolerance = Tolerance(tolerance.atol + 2 * shift, tolerance.rtol, tolerance.reason + why)
    steps = sum(len(m.blocks) for m in loaded) * sum(len(g) for g in groups) if streamed else 0
    bar = progress.bar(total=steps, desc="verifying", unit="image-block") if streamed else None
    report = compare_models(
        ref,
        out,
        groups,
        reference_name=names[0],
        model_name=names[1],
        family=family.name,
        inputs_desc=described + (", forward_features tokens" if tokens else ""),
        batch_size=options.batch_size,
        weights_dtype=str(weights).removeprefix("torch."),
        tolerance=tolerance,
        forward=forward,
        progress=lambda batches: progress.bar(list(batches), desc="verifying", unit="batch"),
        run=run if streamed else None,
    )
    if bar is not None:
        bar.close()
    report.seconds = {k: round(v + loading[k], 3) for k, v in report.seconds.items()}
    whole = " (transformers' model loaded whole)" if streamed and independent else ""
    if streamed and legacy:  # torch maps zip files only
        whole += "; the source read whole, a legacy .pth: re-save it with torch.save to map it"
    report.path = ("one block at a time" if streamed else "in memory") + whole
    return report
