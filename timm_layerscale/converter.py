"""Convert and verify: resolve, read and detect once (:func:`read_source`), then remap, check, verify and
write (:func:`convert_checkpoint`, which export and the release pipeline call)."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._version import __version__
from .conversion.detect import Detection, detect, state_dict_shapes, without_zero_optional
from .conversion.fold import fold_state_dict
from .conversion.keys import detect_layout, dropped, official_checkpoint, remap, state_dict_of, to_gamma, to_layerscale
from .errors import ArchitectureError, CheckpointError, LayerScaleError, ParityError, RemapError, option
from .families import FAMILIES, LAYOUTS, Variant, get_family, get_variant
from .files.atomic import output_path
from .files.read import (
    check_checksums,
    check_finite,
    load_checkpoint,
    nonfinite_tensors,
    parse_dtype,
    read_state_dict,
    sha256_file,
)
from .files.save import output_format, save_pth, save_safetensors
from .files.sources import public_source
from .options import command_line
from .parity.compare import ParityReport, compare_weights
from .parity.tolerance import VerifyOptions
from .parity.verify import verify_outputs

__all__ = ["ConversionResult", "Source", "convert_checkpoint", "read_source", "verify_checkpoint"]


def _background(fn: Callable[[Path], Any], path: Path) -> Future[Any]:
    """``fn(path)`` in a daemon thread (hashlib and zlib release the GIL, so a source is hashed and checked while
    it converts), whose result the Future holds; a process that fails early exits without waiting for it."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(path))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


@dataclass
class Source:
    """A checkpoint read and detected once: the source as given, the local file, its tensors (unwrapped, prefix-free,
    in their own layout, memory-mapped), their :class:`~timm_layerscale.conversion.detect.Detection`, whether they
    were found finite, the zip checksums being checked in a thread, and whether ``'model_ema'`` was read."""

    given: str
    path: Path
    state_dict: dict[str, torch.Tensor]
    detection: Detection
    finite: bool = False
    intact: Future[None] | None = None
    ema: bool = False

    def check(self) -> None:
        """Wait for the zip checksums; a :class:`~timm_layerscale.errors.CheckpointError` if one fails."""
        if self.intact is not None:
            self.intact.result()


def read_source(source: str | os.PathLike[str], *, model: str | None = None, ema: bool = False) -> Source:
    """Resolve, read (zip checksums checked meanwhile) and detect a local file or folder, ``https://`` URL or
    ``hf-hub:ORG/REPO[/FILE]``; ``model`` overrides detection, ``ema`` takes the ``'model_ema'`` weights.

    Raises:
        LayerScaleError: The source cannot be read or fits no variant; the message names the file.
    """
    if model:
        get_variant(model)  # a wrong name is the caller's mistake, not the file's
    path, sd = read_state_dict(source, ema, checksums=False)
    intact = _background(check_checksums, path)
    try:
        return Source(os.fspath(source), path, sd, detect(sd, model), intact=intact, ema=ema)
    except (ArchitectureError, RemapError) as e:
        raise type(e)(f"{path}: {e}") from None


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did: the output, the variant and its ``model_args`` (``num_classes`` /
    ``img_size`` where they differ), the source as given (a URL without credentials), the file read and its
    SHA-256, both layouts, the safetensors metadata, the parity report (``None`` unverified), wall seconds, a
    command line that reproduces it, the container (``"plain"`` or the official wrapper) and the tensors written.
    """

    output: Path
    variant: Variant
    model_args: dict[str, int]
    source: str
    source_path: Path
    source_sha256: str
    source_layout: str
    target_layout: str
    metadata: dict[str, str]
    report: ParityReport | None
    seconds: float
    command: str
    container: str = "plain"
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


def _target(
    tensors: Mapping[str, torch.Tensor],
    found: Detection,
    to: str,
    fold: bool,
    changes: list[tuple[str, str]] | None = None,
) -> dict[str, torch.Tensor]:
    """A source's tensors (in their own layout) mapped by the family's rules to layout ``to``, folded with ``fold``;
    ``changes`` gets the source keys dropped or changed on the way (:func:`~.conversion.keys.to_layerscale`)."""
    family = get_family(found.variant.family)
    buffers = family.official_buffers(found.variant, tensors)  # a file's must be those the model computes
    ls = to_layerscale(tensors, family, changes)
    ls = without_zero_optional(ls, family.name, state_dict_shapes(found.variant), found.variant.name, changes)
    if to == "ls":
        return fold_state_dict(ls) if fold else ls
    out = to_gamma(ls, family) if to == "gamma" else remap(ls, family, to)
    return {**out, **buffers} if to == family.official_layout else out  # the official loader wants them


def cast_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, family: str
) -> dict[str, torch.Tensor]:
    """The cast step: the family's :meth:`~timm_layerscale.families.Family.cast` of the converted tensors."""
    return get_family(family).cast(tensors, dtype)


def _failed(report: ParityReport, weights: str | None = None) -> ParityError:
    """The error of a failed check: the outputs, or with ``weights`` (the first difference) the written file."""
    needed = "bit-exact required" if report.atol == report.rtol == 0 else f"atol={report.atol:g}, rtol={report.rtol:g}"
    what = f"converted model does not match {report.reference} (max abs diff {report.max_abs_diff:.3g}, {needed})"
    what = f"the written file differs from the source ({weights})" if weights else what
    return ParityError(f"{what}; nothing written", report)


def _check_written(
    written: Path, src: Source, to: str, fold: bool, dtype: torch.dtype | None, report: ParityReport
) -> None:
    """The one weight comparison: the written file, read back, against the source file's tensors read on their own,
    mapped by the rules and cast as requested; a difference is a :class:`ParityError` (the file is not kept)."""
    family = get_family(src.detection.variant.family)
    changes: list[tuple[str, str]] = []
    source = read_state_dict(src.path, src.ema, checksums=False)[1]
    expected = family.cast(_target(source, src.detection, to, fold, changes), dtype)  # the request, not the cast
    same, count, detail = compare_weights(expected, state_dict_of(load_checkpoint(written)))
    rewritten = {k for k in expected if re.fullmatch(family.computed, k)}  # buffers a layout computes, written again
    report.add_weights(same, count, dropped(changes, kept=rewritten))
    if not same:
        raise _failed(report, detail)


def convert_checkpoint(
    source: str | os.PathLike[str] | Source,
    output: str | os.PathLike[str],
    *,
    model: str | None = None,
    to: str = "ls",
    fmt: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    allow_nonfinite: bool = False,
    ema: bool = False,
    fold: bool = False,
    options: VerifyOptions | None = None,
    plain: bool = False,
) -> ConversionResult:
    """Convert a checkpoint to the LayerScale-module layout (or back), verify it and write it.

    With ``verify`` the converted model runs against the reference before anything is written, each reading its
    tensors through the loader native to its layout, in fp32 (:func:`~timm_layerscale.parity.verify.verify_outputs`);
    the written file, read back before it is put in place, must equal the source's tensors mapped and cast as asked.
    ``to="gamma"`` as ``.pth`` writes what the official code saves unless ``plain``.

    Args:
        source: File or folder, ``https://`` URL, ``hf-hub:ORG/REPO[/FILE]``, or a :class:`Source`.
        output: ``.safetensors`` or ``.pth`` (``.pt``, ``.bin``, ``.ckpt``), or any name with ``fmt``
            (``"safetensors"`` or ``"pth"``).
        model, ema: A model name overriding detection; take the ``'model_ema'`` weights.
        to, plain: ``"ls"`` (``ls1.gamma``) or ``"gamma"`` (``gamma_1``); with ``plain`` no official wrapper.
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``; default keeps the source's.
        overwrite, verify, allow_nonfinite: Replace an existing output; check parity first; accept NaN/Inf.
        fold: Fold every gamma into the linear layer before it (``ls`` only; load with ``folded_layerscale=True``).
        options: Verification tolerances, inputs and device.

    Raises:
        LayerScaleError: Bad options, or an error reading, detecting or writing.
        ParityError: The converted model does not match the reference, or the written file the source (nothing
            written).
    """
    t0 = time.perf_counter()
    fmt = output_format(output, fmt)
    if to not in LAYOUTS:
        raise LayerScaleError(f"unknown target layout {to!r}; use one of: {', '.join(LAYOUTS)}")
    if fold and to != "ls":
        raise LayerScaleError(
            f"folding applies to the ls layout only; leave out {option('to', 'gamma')} or {option('fold')}"
        )
    if plain and to != "gamma":
        raise LayerScaleError("plain applies to the gamma layout only (an ls file is always plain); leave it out")
    target_file = output_path(output, overwrite)  # before a download
    torch_dtype = parse_dtype(dtype) if dtype else None
    src = source if isinstance(source, Source) else read_source(source, model=model, ema=ema)
    if target_file.exists() and target_file.samefile(src.path):  # replacing it would lose the source
        raise CheckpointError(f"output {output} is the source file itself; choose another output path")
    digest = _background(sha256_file, src.path)
    if not allow_nonfinite and not src.finite:
        advice = f"check the source checkpoint, or pass {option('allow_nonfinite')} to convert anyway"
        try:
            check_finite(src.state_dict, src.path, advice)
        except CheckpointError:
            src.check()  # damage inside the file can read as NaN: say that first
            raise
    variant, args = src.detection.variant, src.detection.model_args
    target = _target(src.state_dict, src.detection, to, fold)
    if verify:  # verified as written; unverified, the writer casts
        target = cast_tensors(target, torch_dtype, variant.family)
    # the source is finite: a non-finite value after the cast is an overflow
    if torch_dtype is not None and not allow_nonfinite and (over := nonfinite_tensors(target, torch_dtype)):
        wider = f"pass {option('dtype', 'bf16')}, or " if torch_dtype == torch.float16 else ""  # fp32's range
        raise CheckpointError(
            f"{src.path}: {over[0]!r} holds values beyond {dtype}'s range (up to {torch.finfo(torch_dtype).max:g}), "
            f"which the cast makes Inf; {wider}leave out {option('dtype', dtype)}"
        )
    found, tensors = src.detection, src.state_dict
    report = (
        verify_outputs(found, tensors, target, to, dtype=torch_dtype, folded=fold, options=options) if verify else None
    )
    if report is not None and not report.passed:
        raise _failed(report)
    metadata = {
        "format": "pt",
        "source_file": src.path.name,
        "source_sha256": "0" * 64,  # written in once known: the hash runs on meanwhile
        "source_layout": src.detection.layout,
        "target_layout": to,
        "architecture": variant.name,
        "family": variant.family,
        "converter": f"timm-layerscale {__version__}",
        **{k: str(v) for k, v in args.items()},
        **({"folded_layerscale": "true"} if fold else {}),
        **(report.metadata() if report is not None else {"parity": "not verified"}),
        # put in place only once the written file, read back, equals the source (_check_written)
        **({"parity_weights": f"{len(target)} tensors equal to the source's"} if report is not None else {}),
    }
    keep = {k for k in target if re.fullmatch(FAMILIES[variant.family].computed, k)}  # never cast
    official = to == "gamma" and fmt == "pth" and not plain
    prefix = FAMILIES[variant.family].official_prefix
    wrapped = f"{{{prefix!r} + key: tensor}}" if prefix else "state_dict"

    def late() -> dict[str, str]:  # once the tensors are written, before the output is put in place
        src.check()
        return {"source_sha256": digest.result()}

    def check(written: Path) -> None:  # the written file, before it is put in place
        metadata["source_sha256"] = digest.result()
        if report is not None:
            _check_written(written, src, to, fold, torch_dtype, report)

    if fmt == "pth":
        src.check()
        wrap = (lambda sd: official_checkpoint(sd, variant.family)) if official else None
        save_pth(output, target, overwrite=overwrite, dtype=torch_dtype, keep=keep, wrap=wrap, check=check)
    else:
        save_safetensors(
            output, target, metadata, overwrite=overwrite, dtype=torch_dtype, keep=keep, late_metadata=late, check=check
        )
    command = command_line(
        ("timm-layerscale", "convert", public_source(src.given), output), options if verify else None,
        model=model, to=None if to == "ls" else to, dtype=dtype, overwrite=overwrite or None, no_verify=not verify,
        format=None if fmt == "safetensors" and Path(output).suffix == ".safetensors" else fmt,
        allow_nonfinite=allow_nonfinite, ema=ema, fold=fold, plain=plain,
    )  # fmt: skip
    return ConversionResult(
        Path(output), variant, args, public_source(src.given), src.path, metadata["source_sha256"],
        src.detection.layout, to, metadata, report, time.perf_counter() - t0, command,
        container=f"{{'model': {wrapped}}}" if official else "plain", state_dict=target,
    )  # fmt: skip


def verify_checkpoint(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    converted: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    model: str | None = None,
    ema: bool = False,
    options: VerifyOptions | None = None,
) -> ParityReport:
    """Compare the reference model on the original weights (file, URL, ``hf-hub:`` id or state dict) with the
    model on the converted ones (file or state dict, either layout, folded or not), as :func:`convert_checkpoint`
    does, and every converted tensor with the source's mapped by the rules. ``model`` overrides detection, ``ema``
    takes the source's ``'model_ema'``.

    Raises:
        RemapError: ``converted`` is not a conversion of ``source``.
    """
    if isinstance(source, Mapping):
        tensors = state_dict_of(source, ema=ema)
        found = detect(tensors, model)
    else:
        (src := read_source(source, model=model, ema=ema)).check()
        tensors, found = src.state_dict, src.detection
    conv_sd = state_dict_of(converted) if isinstance(converted, Mapping) else read_state_dict(converted)[1]
    folded = detect_layout(conv_sd) == "none"  # the source has gates (detection found them): these were folded
    layout = "ls" if folded else detect_layout(conv_sd)
    floating = {v.dtype for v in conv_sd.values() if v.is_floating_point()}
    dtype = floating.pop() if len(floating) == 1 else None
    try:
        report = verify_outputs(found, tensors, conv_sd, layout, dtype=dtype, folded=folded, options=options)
        expected = {
            k: v.to(conv_sd[k].dtype) if k in conv_sd else v for k, v in _target(tensors, found, layout, folded).items()
        }
        report.add_weights(*compare_weights(expected, conv_sd)[:2])
        return report
    except RemapError as e:  # the source fits its model (detection checked it), so the converted weights do not
        conv_name = "the converted state dict" if isinstance(converted, Mapping) else str(converted)
        src_name = "the source" if isinstance(source, Mapping) else str(source)
        raise RemapError(
            f"{conv_name} is not a conversion of {src_name}: {e}; pass the weights converted from it"
        ) from None
