"""Convert and verify, end to end: the orchestration the command line and library users call.

A conversion is a sequence of named steps: (1) resolve the source to a local file
(:func:`~timm_layerscale.files.sources.resolve_source`), (2-3) read its state dict and
detect the variant (``_read``), (4) remap the keys to the target layout
(``_to_target``), (5) hash the file, check its checksums and NaN/Inf (``_hash_and_check``),
(6) verify in memory (``_verified``), (7) write atomically
(:mod:`~timm_layerscale.files.save`) and read back what was written.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._version import __version__
from .conversion.detect import Detection, Variant, detect, get_variant, model_args
from .conversion.fold import fold_state_dict
from .conversion.keys import detect_layout, official_checkpoint, state_dict_of, to_gamma
from .errors import ArchitectureError, CheckpointError, LayerScaleError, ParityError, RemapError
from .families import FAMILIES, check_rope_buffers, official_rope_buffers
from .files import atomic, save
from .files import read as ckpt
from .files.sources import is_remote, public_source, resolve_source
from .parity.compare import ParityReport, compare_weights
from .parity.tolerance import VerifyOptions
from .parity.verify import verify_state_dicts

__all__ = [
    "ConversionResult",
    "convert_checkpoint",
    "verify_checkpoint",
    "load_source",
]


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did.

    Attributes:
        output: The written file.
        variant: The architecture the checkpoint was converted as.
        num_classes: Classifier size when it differs from the variant's default, else ``None``.
        img_size: The resolution a checkpoint was fine-tuned at when no variant of its
            architecture is registered at it (its models take ``img_size=``), else ``None``.
        source: The source as given (path, URL or ``hf-hub:`` id); a URL without the user name,
            password and query that can hold credentials, as summaries and model cards show it
            (:func:`~timm_layerscale.files.sources.public_source`).
        source_path: The local file that was read.
        source_sha256: SHA-256 of that file.
        source_layout: ``"gamma"`` or ``"ls"``.
        target_layout: ``"ls"`` or ``"gamma"``.
        metadata: The metadata written into a safetensors output.
        report: The parity report, or ``None`` with ``verify=False``.
        seconds: Wall time of the conversion, verification included.
        command: A command line that reproduces the conversion.
        container: How the output holds the state dict: ``"plain"``, or the
            official training code's wrapper (``"{'model': {'module.' + key: tensor}}"``).
    """

    output: Path
    variant: Variant
    num_classes: int | None
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
    img_size: int | None = None


def load_source(
    source: str | os.PathLike[str], *, model: str | None = None, ema: bool = False
) -> tuple[Path, Mapping[str, torch.Tensor], Variant, dict[str, Any]]:
    """Read a checkpoint, check a ``.pth``'s zip checksums and find what it is.

    Args:
        source: Local path, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``.
        model: Model name overriding architecture detection.
        ema: Take the ``'model_ema'`` state dict of a training checkpoint.

    Returns:
        ``(path, state_dict, variant, info)``: the local file, its state dict
        (unwrapped, prefixes stripped, tensors lazy where the format allows), the
        detected variant and :func:`~timm_layerscale.conversion.detect.describe_state_dict` info.
    """
    path = resolve_source(source)
    sd, found = _read(path, model=model, ema=ema)
    ckpt.check_checksums(path)  # before anything is said of the values: damage can read as NaN
    return path, sd, found.variant, found.info


def _read(path: Path, *, model: str | None, ema: bool) -> tuple[dict[str, torch.Tensor], Detection]:
    """Step 2-3: load the file's state dict and detect its variant."""
    if model:
        get_variant(model)  # a wrong name is the caller's mistake, not the file's
    try:
        sd = state_dict_of(ckpt.load_checkpoint(path), ema=ema)
    except RemapError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if all(isinstance(v, Mapping) and not v for v in sd.values()):  # {} or {'state_dict': {}}
        raise CheckpointError(f"{path} holds no weights (an empty state dict); pass a checkpoint with weights")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is not a tensor; the file is not a state dict")
    try:
        return sd, detect(sd, model)
    except (ArchitectureError, RemapError) as e:  # name the file, as the errors above do
        raise type(e)(f"{path}: {e}") from None


def _to_target(sd: Mapping[str, torch.Tensor], found: Detection, to: str) -> dict[str, torch.Tensor]:
    """Step 4: the converted state dict in layout ``to``, from the source and its detection."""
    variant = found.variant
    rope = official_rope_buffers(variant) if variant.family == "vit5" else None
    if rope is not None:  # a file's rotary buffers must be the ones the model computes
        check_rope_buffers(sd, rope)
    if to == "ls":
        return found.state_dict
    out = to_gamma(found.state_dict, FAMILIES[variant.family])
    if rope is not None:  # the official loader needs the rotary tables it keeps as buffers
        out.update(rope)
    return out


def verify_checkpoint(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    converted: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    model: str | None = None,
    ema: bool = False,
    options: VerifyOptions | None = None,
) -> ParityReport:
    """Compare the reference model on the original weights with the converted model.

    Both models run in the converted file's float dtype (the source weights are
    cast to it) on ``options.device``, on seeded images at the model's resolution
    plus any image files; every converted tensor is also compared with its source.
    A file that is a ``.pth`` (a zip) is first checked against its records' CRC-32s.

    Args:
        source: The original checkpoint (file, URL, ``hf-hub:`` id, or a state dict).
        converted: The converted checkpoint (file or state dict), any layout, folded or not.
        model: Model name overriding detection.
        ema: Take the source's ``'model_ema'`` weights.
        options: Tolerances, inputs and device; the default asks for what the
            family's construction guarantees (:func:`~timm_layerscale.parity.tolerance.resolve_tolerance`).

    Returns:
        The :class:`~timm_layerscale.parity.compare.ParityReport`.
    """
    if isinstance(source, Mapping):
        src_sd: Mapping[str, torch.Tensor] = state_dict_of(source, ema=ema)
        found = detect(src_sd, model)
        variant, info = found.variant, found.info
    else:
        _, src_sd, variant, info = load_source(source, model=model, ema=ema)
    if isinstance(converted, Mapping):
        conv_sd = state_dict_of(converted)
    else:
        conv_sd = state_dict_of(ckpt.load_checkpoint(path := resolve_source(converted)))
        ckpt.check_checksums(path)
    try:
        return verify_state_dicts(src_sd, conv_sd, variant, model_args=model_args(info), options=options)
    except RemapError as e:  # the source fits its model (detection checked it), so the converted weights do not
        conv_name = "the converted state dict" if isinstance(converted, Mapping) else str(converted)
        src_name = "the source" if isinstance(source, Mapping) else str(source)
        raise RemapError(
            f"{conv_name} is not a conversion of {src_name}: {e}; pass the weights converted from it"
        ) from None


def _check_not_source(output: Path, source: Path | None) -> None:
    """Refuse an output that is the source file itself: replacing it would lose the source."""
    if source is not None and output.exists() and source.exists() and output.samefile(source):
        raise CheckpointError(f"output {output} is the source file itself; choose another output path")


def convert_checkpoint(
    source: str | os.PathLike[str],
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
    """Convert a checkpoint to the LayerScale-module layout (or back) and verify it.

    With ``verify``, the converted weights (cast to ``dtype``) are compared with the
    source tensor by tensor and the converted model with the reference
    (:func:`~timm_layerscale.parity.verify.verify_state_dicts`) before anything is written; a failed check raises
    :class:`~timm_layerscale.errors.ParityError` and writes nothing. The result goes into the safetensors
    metadata (``parity``: ``bit-exact``, ``within tolerance`` or ``not verified``, with
    the tolerance). The output is written atomically, then read back and compared
    with the verified tensors. The source is hashed (``source_sha256`` in the metadata)
    and, if it is a ``.pth`` (a zip), checked against its records' CRC-32s.

    ``to="gamma"`` writes what the official training code saves: a ``.pth`` file
    holding ``{'model': {'module.' + key: tensor}}`` for CaiT (the official loader
    expects the prefix) and ``{'model': state_dict}`` for DeiT-III and ViT-5, so
    the official code loads it as it is; ``plain=True`` writes the bare state dict
    instead. A safetensors file always holds the bare state dict (timm's own
    layout for its ``cait_*`` Hub copies). A source already in the target
    layout is re-saved: another container or format, ``dtype`` and (for ``ls``) ``fold`` apply.

    Args:
        source: Local file, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``.
        output: Output file (``.safetensors`` or ``.pth``).
        model: Model name overriding architecture detection.
        to: Target layout: ``"ls"`` (``ls1.gamma``) or ``"gamma"`` (``gamma_1``).
        fmt: ``"safetensors"`` or ``"pth"``; default from the output's suffix
            (``.safetensors``; ``.pth``, ``.pt``, ``.bin``, ``.ckpt``); another suffix needs it.
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``; default keeps the source's dtypes.
        overwrite: Replace an existing output.
        verify: Check parity of the written file against the reference.
        allow_nonfinite: Convert even if some tensors hold NaN or Inf.
        ema: Take the source's ``'model_ema'`` weights.
        fold: Fold every LayerScale gamma into the preceding Linear (``ls`` only);
            the output loads into the model built with ``folded_layerscale=True``.
        options: Verification tolerances, inputs and device.
        plain: With ``to="gamma"``, write a ``.pth`` file without the official wrapper.

    Returns:
        A :class:`ConversionResult`.

    Raises:
        LayerScaleError: Bad options, or any error of reading, detecting or writing.
        ParityError: The written file does not match the reference.
    """
    t0 = time.perf_counter()
    output = atomic.file_path(output)
    fmt = save.output_format(output, fmt)
    if to not in ("ls", "gamma"):
        raise LayerScaleError(f"unknown target layout {to!r}; use 'ls' or 'gamma'")
    if fold and to != "ls":
        raise LayerScaleError("folding applies to the ls layout only; leave out to='gamma' or fold=True")
    if plain and to != "gamma":
        raise LayerScaleError("plain applies to the gamma layout only (an ls file is always plain); leave it out")
    path = None if is_remote(source) else resolve_source(source)  # a download waits until the output is free
    _check_not_source(output, path)
    atomic.check_output(output, overwrite)
    torch_dtype = ckpt.parse_dtype(dtype) if dtype else None

    if path is None:
        path = resolve_source(source)
        _check_not_source(output, path)
    identity = ckpt.file_identity(path)  # checked once the source is no longer read
    sd, found = _read(path, model=model, ema=ema)
    variant, args = found.variant, model_args(found.info)
    layout = detect_layout(sd)
    digest = _hash_and_check(path, sd, allow_nonfinite)
    target = _to_target(sd, found, to)
    if fold:  # to == "ls": target is in the ls layout
        target = fold_state_dict(target)
    metadata = {
        "format": "pt",
        "source_file": path.name,
        "source_sha256": "0" * 64,  # written in once known: the hash runs on meanwhile
        "source_layout": layout,
        "target_layout": to,
        "architecture": variant.name,
        "family": variant.family,
        "converter": f"timm-layerscale {__version__}",
        **{k: str(v) for k, v in args.items()},
        **({"folded_layerscale": "true"} if fold else {}),
    }
    if verify and torch_dtype is not None:  # verified as written; without verification the writer casts
        target = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in target.items()}
    # the source is finite (checked above): a non-finite value after the cast is its overflow
    # (a tensor cast above is not cast again)
    if torch_dtype is not None and not allow_nonfinite and (over := ckpt.nonfinite_tensors(target, torch_dtype)):
        wider = "pass dtype='bf16', or " if torch_dtype == torch.float16 else ""  # bf16 spans fp32's range
        raise CheckpointError(
            f"{path}: {over[0]!r} holds values beyond {dtype}'s range (up to {torch.finfo(torch_dtype).max:g}), "
            f"which the cast makes Inf; {wider}leave out dtype={dtype!r}"
        )
    report = _verified(sd, target, variant, args, options, fold) if verify else None
    metadata.update(report.metadata() if report is not None else {"parity": "not verified"})
    family = FAMILIES[variant.family]
    official = to == "gamma" and fmt == "pth" and not plain
    wrap = functools.partial(official_checkpoint, family=family) if official else None
    save.save_state_dict(
        output,
        target,
        metadata if fmt == "safetensors" else None,
        fmt=fmt,
        overwrite=overwrite,
        dtype=torch_dtype,
        wrap=wrap,
        late_metadata=lambda: {"source_sha256": digest.result()},
    )
    try:
        metadata["source_sha256"] = sha = digest.result()  # after a .pth output is written: an error removes it
        if verify:  # the file holds what was verified
            same, _, detail = compare_weights(target, state_dict_of(ckpt.load_checkpoint(output)))
            if not same:
                raise LayerScaleError(f"{output} does not read back as written ({detail}); output removed")
        ckpt.check_unchanged(path, identity)  # tensors, verification and sha256 came from one version of the file
    except BaseException:
        atomic.write_target(output).unlink(missing_ok=True)  # the file written, not a link leading to it
        raise
    from .options import command_line

    command = command_line(
        ("timm-layerscale", "convert", source, output),
        options if verify else None,
        model=model,
        to=None if to == "ls" else to,
        format=None if fmt == "safetensors" and output.suffix == ".safetensors" else fmt,
        dtype=dtype,
        overwrite=overwrite or None,
        no_verify=not verify,
        allow_nonfinite=allow_nonfinite,
        ema=ema,
        fold=fold,
        plain=plain,
    )
    return ConversionResult(
        output=output,
        variant=variant,
        num_classes=args.get("num_classes"),
        img_size=args.get("img_size"),
        source=public_source(source),
        source_path=path,
        source_sha256=sha,
        source_layout=layout,
        target_layout=to,
        metadata=metadata,
        report=report,
        seconds=time.perf_counter() - t0,
        command=command,
        container=_container(family.official_prefix) if official else "plain",
    )


class _Hash(threading.Thread):
    """A file's SHA-256, computed in a thread of its own (hashlib releases the GIL); a daemon, so
    that an error or an interruption meanwhile does not wait for it."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.digest = path, ""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.digest = ckpt.sha256_file(self.path)
        except BaseException as e:
            self.error = e

    def result(self) -> str:
        self.join()
        if self.error is not None:
            raise self.error
        return self.digest


def _hash_and_check(path: Path, sd: Mapping[str, torch.Tensor], allow_nonfinite: bool) -> _Hash:
    """Step 5: start hashing the source file, which runs on beside the checks of its zip checksums
    and for NaN/Inf (unless allowed), verification and the write."""
    digest = _Hash(path)
    ckpt.check_checksums(path)
    if not allow_nonfinite:
        ckpt.check_finite(sd, path)
    return digest


def _verified(
    sd: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    variant: Variant,
    args: Mapping[str, Any],
    options: VerifyOptions | None,
    folded: bool,
) -> ParityReport:
    """Step 6: the parity report of the converted weights; a failed check raises and nothing is written."""
    report = verify_state_dicts(sd, target, variant, model_args=args, options=options, folded=folded)
    if report.passed:
        return report
    if report.weights_equal is False:
        what = "converted weights differ from the source"
    else:
        needed = (
            "bit-exact required"
            if report.atol == 0 and report.rtol == 0
            else f"atol={report.atol:g}, rtol={report.rtol:g}"
        )
        what = f"converted model does not match {report.reference} (max abs diff {report.max_abs_diff:.3g}, {needed})"
    raise ParityError(f"{what}; nothing written", report)


def _container(prefix: str) -> str:
    """How the official training code's wrapper holds the state dict, in words."""
    return f"{{'model': {{{prefix!r} + key: tensor}}}}" if prefix else "{'model': state_dict}"
