"""Convert and verify: a source read and detected once (:func:`~timm_layerscale.files.read.read_source`), then
remap, check, verify and write (:func:`convert_checkpoint`, which export and the release pipeline call)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._version import __version__
from .conversion.detect import NoGates, detect
from .conversion.rules import Change, cast_tensors, describe_changes, renamed_keys, target_tensors
from .errors import ArchitectureError, CheckpointError, LayerScaleError, RemapError, option
from .families import ALIAS, LAYOUT_NAMES, Layout, Variant
from .files.atomic import output_path
from .files.read import (
    Source,
    check_finite,
    nonfinite_tensors,
    parse_dtype,
    public_source,
    read_checkpoint,
    read_source,
    read_state_dict,
)
from .files.save import output_format, save_pth, save_safetensors
from .options import command_line
from .parity.compare import ParityReport
from .parity.tolerance import VerifyOptions
from .parity.verify import verify_outputs
from .parity.weights import check_written, compare_files, parity_error

__all__ = ["ConversionResult", "Source", "check_request", "convert_checkpoint", "read_source", "target_layout"]
__all__ += ["verify_checkpoint"]


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did: the output, the variant and its ``overrides`` (``num_classes`` /
    ``img_size`` where they differ), the source as given (a URL without credentials), the file read and its
    SHA-256, both layouts, the safetensors metadata, the parity report (``None`` unverified), wall seconds, a
    command line that reproduces it, the container, the tensors written, the keys renamed (source and written
    names, block numbers as ``N``), the tensors dropped, taken apart or synthesised with their proofs
    (:func:`~timm_layerscale.conversion.rules.describe_changes`), the line saying which layout ``gamma`` named, and
    the wall seconds of each phase (``read``, ``rules``, ``reference``, ``converted model``, ``write``, ``weight
    check``; ``write`` includes waiting for the source's SHA-256 and checksums).
    """

    output: Path
    variant: Variant
    overrides: dict[str, int]
    source: str
    source_path: Path
    source_sha256: str
    source_layout: str
    target_layout: str
    metadata: dict[str, str]
    report: ParityReport | None
    seconds: float
    command: str
    container: str = "state dict"
    state_dict: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    renamed: list[tuple[str, str]] = field(default_factory=list, repr=False)
    changed: str = ""
    note: str = ""
    phases: dict[str, float] = field(default_factory=dict)


def target_layout(variant: Variant, to: str, fmt: str, plain: bool = False) -> tuple[Layout, str]:
    """The layout ``--to`` names for ``variant``'s family and an output of format ``fmt``, and a line saying which,
    where the release word ``gamma`` (or the deprecated ``plain``) named it.

    Raises:
        RemapError: The family does not write that layout; the message names those it does.
    """
    family = variant.family
    if to != ALIAS and not plain:
        return family.layout(to, written=True), ""
    name = family.alias(fmt, wrapped=not plain)
    word = "--plain is deprecated" if plain else f"{ALIAS!r} is a word of one release"
    return family.layout(name, written=True), f"{word}: wrote {family.title}'s {name} layout; pass --to {name}"


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
    """Convert a checkpoint into a layout of its family, verify it and write it.

    With ``verify`` the converted model runs against the reference before anything is written, each reading its
    tensors through the loader native to its layout, in fp32 (:func:`~timm_layerscale.parity.verify.verify_outputs`);
    the written file, read back before it is put in place, must equal the source's tensors mapped and cast as asked,
    in the layout's container (``{'model': ...}`` of an official ``.pth``).

    Args:
        source: File or folder, ``https://`` URL, ``hf-hub:ORG/REPO[/FILE]``, or a :class:`Source`.
        output: ``.safetensors`` or ``.pth`` (``.pt``, ``.bin``, ``.ckpt``), or any name with ``fmt``
            (``"safetensors"`` or ``"pth"``).
        model, ema: A model name overriding detection; take the ``'model_ema'`` weights.
        to: ``"ls"``, ``"timm"``, ``"official"`` or ``"transformers"``, where the family has it; ``"gamma"``, a
            word of one release, names the official file for a ``.pth`` (timm's layout for DINOv3) and timm's
            layout otherwise (:func:`target_layout`).
        plain: Deprecated: ``to="gamma"`` without the official container, which is timm's layout.
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``; default keeps the source's.
        overwrite, verify, allow_nonfinite: Replace an existing output; check parity first; accept NaN/Inf.
        fold: Fold every gamma into the linear layer before it (``ls`` only; load with ``folded_layerscale=True``).
        options: Verification tolerances, inputs and device.

    Raises:
        LayerScaleError: Bad options, or an error reading, detecting or writing.
        ParityError: The converted model does not match the reference, or the written file the source (nothing
            written).
    """
    phases = _Phases()
    fmt = output_format(output, fmt)
    check_request(to, fold=fold, plain=plain)
    target_file = output_path(output, overwrite)  # before a download
    torch_dtype = parse_dtype(dtype) if dtype else None
    src = source if isinstance(source, Source) else read_source(source, model=model, ema=ema)
    phases.lap("read")
    variant = src.detection.variant
    layout, note = target_layout(variant, to, fmt, plain)
    _check_source(src, layout, fmt, target_file, allow_nonfinite)
    changes: list[Change] = []
    written: list[Change] = []
    mapped = target_tensors(src.state_dict, variant, src.detection.layout, layout, fold, torch_dtype, changes, written)
    if dtype and not allow_nonfinite:
        _check_range(src, mapped, dtype)
    target = cast_tensors(mapped, torch_dtype, layout.computed(variant))  # as written, each cast as it is read
    phases.lap("rules")
    report = _verify(src, target, layout, torch_dtype, fold, options, phases) if verify else None
    metadata = _metadata(src, layout, fold, report, len(target))
    _write(output, fmt, target, metadata, src, layout, torch_dtype, overwrite, report, fold, phases)
    phases.lap("write")
    command = command_line(
        ("timm-layerscale", "convert", public_source(src.given), output),
        options if verify else None,
        model=model,
        to=None if to == "ls" else to,
        dtype=dtype,
        overwrite=overwrite or None,
        no_verify=not verify,
        format=None if fmt == "safetensors" and Path(output).suffix == ".safetensors" else fmt,
        allow_nonfinite=allow_nonfinite,
        ema=ema,
        fold=fold,
        plain=plain,
    )
    return ConversionResult(
        output=Path(output),
        variant=variant,
        overrides=src.detection.overrides,
        source=public_source(src.given),
        source_path=src.path,
        source_sha256=metadata["source_sha256"],
        source_layout=src.detection.layout.name,
        target_layout=layout.name,
        metadata=metadata,
        report=report,
        seconds=time.perf_counter() - phases.start,
        command=command,
        container=layout.container if fmt == "pth" else "state dict",
        state_dict=target,
        renamed=renamed_keys(changes, written),
        changed=describe_changes([*changes, *written]),
        note=note,
        phases=dict(phases),
    )


class _Phases(dict[str, float]):
    """The wall seconds of a conversion's phases, each :meth:`lap` adding the time since the last to one."""

    def __init__(self) -> None:
        super().__init__()
        self.start = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self[phase] = round(self.get(phase, 0.0) + now - self.last, 3)
        self.last = now


def check_request(to: str, *, fold: bool = False, plain: bool = False, folder: bool = False) -> None:
    """The one request check of :func:`convert_checkpoint` and export (``folder``), before anything is read: one-line
    errors for a target layout no family has, one a folder cannot hold (the authors' file), and options that do not
    go together."""
    if to not in LAYOUT_NAMES:
        raise LayerScaleError(f"unknown target layout {to!r}; use one of: {', '.join(LAYOUT_NAMES)}")
    if folder and to == "official":
        raise CheckpointError(
            f"export writes folders that timm or transformers load; for the official file, convert {option('to', to)}"
        )
    if fold and to != "ls":
        raise LayerScaleError(
            f"folding applies to the ls layout only; leave out {option('to', to)} or {option('fold')}"
        )
    if plain and to != ALIAS:
        raise LayerScaleError(f"plain applies to {option('to', ALIAS)} only; pass {option('to', 'timm')} instead")


def _check_source(src: Source, layout: Layout, fmt: str, target_file: Path, allow_nonfinite: bool) -> None:
    """One-line errors for an output that cannot hold the layout's container or that is the source itself, and
    unless ``allow_nonfinite`` for a NaN or Inf of the source (a damaged file's checksum said first)."""
    family = src.detection.variant.family
    if layout.wrapper and fmt != "pth":
        raise CheckpointError(
            f"the {layout.name} {family.title} file is {layout.container} in a .pth; name the output .pth, "
            f"or pass {option('to', 'timm' if 'timm' in family.layouts else 'ls')}"
        )
    if target_file.exists() and target_file.samefile(src.path):  # replacing it would lose the source
        raise CheckpointError(f"output {target_file} is the source file itself; choose another output path")
    if src.finite or allow_nonfinite:
        return
    advice = f"check the source checkpoint, or pass {option('allow_nonfinite')} to convert anyway"
    try:
        check_finite(src.state_dict, src.path, advice)
    except CheckpointError:
        src.check()  # damage inside the file can read as NaN: say that first
        raise


def _verify(
    src: Source,
    target: Mapping[str, torch.Tensor],
    layout: Layout,
    dtype: torch.dtype | None,
    fold: bool,
    options: VerifyOptions | None,
    phases: _Phases,
) -> ParityReport:
    """The parity report of ``target`` (in ``layout``, cast to ``dtype``, folded with ``fold``) against the
    reference on the source (:func:`~timm_layerscale.parity.verify.verify_outputs`), its phases' seconds added
    to ``phases``; a :class:`~timm_layerscale.errors.ParityError` where it fails."""
    report = verify_outputs(
        src.detection,
        src.state_dict,
        target,
        layout,
        dtype=dtype,
        folded=fold,
        options=options,
        args=src.args,
        legacy=src.legacy,
    )
    if not report.passed:
        raise parity_error(report)
    phases.update(report.seconds)
    phases.last = time.perf_counter()
    return report


def _check_range(src: Source, target: Mapping[str, torch.Tensor], dtype: str) -> None:
    """A one-line error naming a tensor of the (finite) source that ``dtype`` cannot hold: the cast would make Inf."""
    torch_dtype = parse_dtype(dtype)
    if over := nonfinite_tensors(target, torch_dtype):
        wider = f"pass {option('dtype', 'bf16')}, or " if torch_dtype == torch.float16 else ""  # fp32's range
        raise CheckpointError(
            f"{src.path}: {over[0]!r} holds values beyond {dtype}'s range (up to {torch.finfo(torch_dtype).max:g}), "
            f"which the cast makes Inf; {wider}leave out {option('dtype', dtype)}"
        )


def _metadata(src: Source, layout: Layout, fold: bool, report: ParityReport | None, count: int) -> dict[str, str]:
    """A conversion's safetensors metadata (the source's SHA-256 written in once known)."""
    variant = src.detection.variant
    return {
        "format": "pt",
        "source_file": src.path.name,
        "source_sha256": "0" * 64,  # written in once known: the hash runs on meanwhile
        "source_layout": src.detection.layout.name,
        "target_layout": layout.name,
        "architecture": variant.name,
        "family": variant.family.name,
        "converter": f"timm-layerscale {__version__}",
        **{k: str(v) for k, v in src.detection.overrides.items()},
        **({"folded_layerscale": "true"} if fold else {}),
        **(report.metadata() if report is not None else {"parity": "not verified"}),
        # put in place only once the written file, read back, equals the source (check_written)
        **({"parity_weights": f"{count} tensors equal to the source's"} if report is not None else {}),
    }


def _write(
    output: str | os.PathLike[str],
    fmt: str,
    target: Mapping[str, torch.Tensor],
    metadata: dict[str, str],
    src: Source,
    layout: Layout,
    dtype: torch.dtype | None,
    overwrite: bool,
    report: ParityReport | None,
    fold: bool,
    phases: _Phases,
) -> None:
    """``target`` written to ``output`` in ``fmt`` (a ``.pth`` in the layout's container), cast to ``dtype`` but the
    layout's computed buffers; before the file is put in place the source must be unchanged, its SHA-256 goes into
    ``metadata`` and, verified (``report``), the file read back must equal the source's tensors
    (:func:`~timm_layerscale.parity.weights.check_written`)."""

    def check(written: Path) -> None:
        src.unchanged()
        metadata["source_sha256"] = src.check()
        if report is not None:
            phases.lap("write")
            check_written(written, src, layout, fold, dtype, report)
            phases.lap("weight check")

    keep = layout.computed(src.detection.variant)  # never cast
    if fmt == "pth":
        src.check()
        wrap = layout.wrap if layout.wrapper or layout.prefix else None
        save_pth(output, target, overwrite=overwrite, dtype=dtype, keep=keep, wrap=wrap, check=check)
    else:
        save_safetensors(
            output,
            target,
            metadata,
            overwrite=overwrite,
            dtype=dtype,
            keep=keep,
            late_metadata=lambda: {"source_sha256": src.check()},
            check=check,
        )


def verify_checkpoint(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    converted: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    model: str | None = None,
    ema: bool = False,
    options: VerifyOptions | None = None,
) -> ParityReport:
    """Compare the reference model on the original weights (file, URL, ``hf-hub:`` id or state dict) with the
    model on the converted ones (file, folder, URL, ``hf-hub:`` id or state dict, in any layout of the family, folded
    or not), as :func:`convert_checkpoint` does, and every converted tensor with the source's mapped by the rules. The
    converted file's layout is told as detection tells a source's. ``model`` overrides detection, ``ema`` takes the source's
    ``'model_ema'``.

    Raises:
        RemapError: ``converted`` is not a conversion of ``source``.
    """
    if isinstance(source, Mapping):
        tensors, held = read_state_dict(source, ema)
        src = Source("the source", Path("."), tensors, detect(tensors, model, held))
    else:
        (src := read_source(source, model=model, ema=ema, digest=False)).check()  # the checksums alone
    variant = src.detection.variant
    stored: tuple[str | None, str] | None
    if isinstance(converted, Mapping):
        conv_sd, container = read_state_dict(converted)
        stored = container
    else:  # a folder's or repository's weights file too, its zip checksums checked
        path, conv_sd, container = read_checkpoint(converted)
        stored = None if path.suffix == ".safetensors" else container
    conv_name = "the converted state dict" if isinstance(converted, Mapping) else str(converted)
    src_name = "the source" if isinstance(source, Mapping) else str(source)
    try:
        try:
            layout, folded = detect(conv_sd, variant.name, container).layout, False
        except NoGates:  # the weights the gates were folded into
            layout, folded = variant.family.layouts["ls"], True
        keep = layout.computed(variant)
        floating = {v.dtype for k, v in conv_sd.items() if v.is_floating_point() and k not in keep}
        dtype = floating.pop() if len(floating) == 1 else None
        report = verify_outputs(
            src.detection,
            src.state_dict,
            conv_sd,
            layout,
            dtype=dtype,
            folded=folded,
            options=options,
            args=src.args,
            legacy=src.legacy,
        )
        compare_files(src.state_dict, src.detection, layout, folded, dtype, conv_sd, stored, report, meaning=True)
        return report
    except (RemapError, ArchitectureError) as e:  # the source fits its model (detection checked it): these do not
        raise RemapError(
            f"{conv_name} is not a conversion of {src_name}: {e}; pass the weights converted from it"
        ) from None
