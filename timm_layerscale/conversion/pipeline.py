"""Convert a checkpoint between layouts, verify the result, and run the offline demo.

The pieces are pure key rules (:mod:`~timm_layerscale.conversion.keys`), file I/O
(:mod:`~timm_layerscale.conversion.io`, :mod:`~timm_layerscale.conversion.save`), the Hub/URL boundary (:mod:`~timm_layerscale.hub.download`)
and the parity check (:mod:`~timm_layerscale.parity.compare`); this module strings them
together for the command line and for library users.
"""
from __future__ import annotations

import functools
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from . import io as ckpt
from . import save, stream
from .._version import __version__
from ..errors import CheckpointError, LayerScaleError, OutputExistsError, RemapError
from ..parity.compare import (
    ParityReport,
    VerifyOptions,
    compare_models,
    compare_weights,
    image_inputs,
    resolve_tolerance,
    seed_parameters_,
    seeded_inputs,
)
from ..progress import verification_passes
from .keys import (
    FAMILIES, check_state_dict, detect_layout, official_checkpoint, strip_prefixes, to_gamma, to_layerscale, unwrap_state_dict,
)
from .detect import Variant, detect_variant, target_shapes

__all__ = [
    "ConversionResult",
    "ParityError",
    "convert_checkpoint",
    "verify_checkpoint",
    "load_source",
    "build_reference",
    "build_converted",
    "command_line",
    "verify_state_dicts",
    "verify_flags",
    "write_official_checkpoint",
]


class ParityError(LayerScaleError):
    """The converted model's outputs do not match the reference's (exit code 1)."""

    exit_code = 1

    def __init__(self, message: str, report: ParityReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did.

    Attributes:
        output: The written file.
        variant: The architecture the checkpoint was converted as.
        num_classes: Classifier size when it differs from the variant's default, else ``None``.
        source: The source as given (path, URL or ``hf-hub:`` id).
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


def load_source(
    source: str | os.PathLike, *, model: str | None = None, ema: bool = False
) -> tuple[Path, Mapping[str, torch.Tensor], Variant, dict[str, Any]]:
    """Read a checkpoint and find what it is.

    Args:
        source: Local path, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``.
        model: Model name overriding architecture detection.
        ema: Take the ``'model_ema'`` state dict of a training checkpoint.

    Returns:
        ``(path, state_dict, variant, info)``: the local file, its state dict
        (unwrapped, prefixes stripped, tensors lazy where the format allows), the
        detected variant and :func:`~timm_layerscale.conversion.detect.describe_state_dict` info.
    """
    path = ckpt.resolve_source(source)
    raw = ckpt.load_checkpoint(path)
    try:
        sd = strip_prefixes(unwrap_state_dict(raw, "model_ema" if ema else None))
    except RemapError as e:
        raise CheckpointError(f"{path}: {e}") from None
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is not a tensor; the file is not a state dict")
    variant, info = detect_variant(sd, model)
    return path, sd, variant, info


def _to_target(sd: Mapping[str, torch.Tensor], variant: Variant, to: str) -> dict[str, torch.Tensor]:
    if variant.family == "vit5":
        from ..models import vit5

        vit5.check_rope_buffers(sd, variant.name)
    ls = to_layerscale(sd, FAMILIES[variant.family])
    if to == "ls":
        return ls
    if to == "gamma":
        out = to_gamma(ls, FAMILIES[variant.family])
        if variant.family == "vit5":
            # The official loader needs the rotary tables it keeps as buffers.
            from ..models import vit5

            out.update(vit5.rope_buffers(variant.name))
        return out
    raise LayerScaleError(f"unknown target layout {to!r}; use 'ls' or 'gamma'")


def _create_empty(name: str, family: str, **kwargs: Any) -> nn.Module:
    """Build a model whose weights are about to be loaded, skipping the random init.

    CaiT models hold no non-persistent buffers, so they are built on the meta
    device and filled by ``load_state_dict(assign=True)``; other families are built
    normally because their computed buffers must exist on the CPU.
    """
    import timm

    if family == "cait":
        with torch.device("meta"):
            return timm.create_model(name, **kwargs)
    return timm.create_model(name, **kwargs)


def _load_strict(model: nn.Module, sd: Mapping[str, torch.Tensor], name: str) -> nn.Module:
    check_state_dict(sd, model.state_dict(), name)
    is_meta = any(p.is_meta for p in model.parameters())
    model.load_state_dict(sd, strict=True, assign=is_meta)
    return model.eval()


def build_converted(
    variant: Variant, state_dict: Mapping[str, torch.Tensor], num_classes: int | None = None, **kwargs: Any
) -> nn.Module:
    """Build the target model and load a state dict in any accepted layout, strictly.

    Raises:
        RemapError: Missing, unexpected or mis-shaped keys (all listed in one message).
    """
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    model = _create_empty(variant.name, variant.family, **kwargs)
    return _load_strict(model, to_layerscale(state_dict, FAMILIES[variant.family]), variant.name)


def build_reference(
    variant: Variant, state_dict: Mapping[str, torch.Tensor], num_classes: int | None = None
) -> tuple[nn.Module, str]:
    """Build the reference model for a variant and load the original weights strictly.

    Returns:
        ``(model, name)``: the reference in eval mode and the name it is reported by.
    """
    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if variant.family == "cait":
        ref = _create_empty(variant.reference, "cait", **kwargs)
        sd = to_gamma(to_layerscale(state_dict, "cait"), "cait")
        return _load_strict(ref, sd, variant.reference), variant.reference
    from ..parity import references

    return references.load_reference(variant, state_dict, num_classes)


def align_attention(reference: nn.Module, model: nn.Module) -> None:
    """Make ``model`` take the reference's attention path.

    timm fuses attention into ``scaled_dot_product_attention`` where it can; a
    reference that computes attention by hand (the official-layout ViT-5) is matched
    by turning fusion off in the converted model, so both run the same arithmetic.
    """
    if not any(getattr(m, "fused_attn", False) for m in reference.modules()):
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False


def _dtype_of(sd: Mapping[str, torch.Tensor]) -> torch.dtype:
    for v in sd.values():
        if v.is_floating_point():
            return v.dtype
    return torch.float32


def _has_layerscale(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(k.endswith(("ls1.gamma", "ls2.gamma", "gamma_1", "gamma_2")) for k in sd)


def _expected_weights(
    src_sd: Mapping[str, torch.Tensor], conv_ls: Mapping[str, torch.Tensor], family: str, fused: bool
) -> dict[str, torch.Tensor]:
    """The source's tensors as the converted ones must be: remapped, folded if ``fused``, cast to their dtypes."""
    from .fold import fold_state_dict

    expected = to_layerscale(src_sd, family)
    if fused:
        expected = fold_state_dict(expected)
    out = {}
    for k, v in expected.items():
        want = conv_ls.get(k)
        out[k] = v.to(want.dtype) if want is not None and v.is_floating_point() else v
    return out


def _device(options: VerifyOptions) -> torch.device:
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(f"--device {options.device}: no CUDA device is available here; use --device cpu")
    return torch.device(options.device)


def verify_state_dicts(
    src_sd: Mapping[str, torch.Tensor],
    conv_sd: Mapping[str, torch.Tensor],
    variant: Variant,
    *,
    num_classes: int | None = None,
    options: VerifyOptions | None = None,
    fused: bool | None = None,
) -> ParityReport:
    """Compare the reference on the original weights with the converted model, and the weights themselves.

    Args:
        src_sd: The original weights (unwrapped, prefixes stripped), any dtype.
        conv_sd: The converted weights, any layout; their float dtype is the check's.
        variant: The architecture.
        num_classes: Classifier size when it differs from the variant's default.
        options: Tolerances, inputs and device (:class:`~timm_layerscale.parity.compare.VerifyOptions`).
        fused: The converted weights have LayerScale folded in; default: detected
            (the source has gammas, the converted weights none).

    Returns:
        The :class:`~timm_layerscale.parity.compare.ParityReport`.
    """
    options = options or VerifyOptions()
    device = _device(options)
    family = FAMILIES[variant.family]
    if fused is None:
        fused = _has_layerscale(src_sd) and not _has_layerscale(conv_sd)
    conv_ls = to_layerscale(conv_sd, family)
    weights = compare_weights(_expected_weights(src_sd, conv_ls, family, fused), conv_ls)
    dtype = _dtype_of(conv_sd)
    tolerance = resolve_tolerance(variant.family, dtype, options, fused=fused)
    ref, ref_name = build_reference(variant, dict(src_sd), num_classes)
    out = build_converted(variant, conv_sd, num_classes, **({"fused_layerscale": True} if fused else {}))
    align_attention(ref, out)
    ref.to(device, dtype)
    out.to(device, dtype)
    img = variant.img_size
    cfg_size = getattr(out, "pretrained_cfg", {}).get("input_size")
    if cfg_size:
        img = tuple(cfg_size[-2:])
    inputs = seeded_inputs(options.num_inputs, img, options.seed)
    size = img if isinstance(img, int) else "x".join(map(str, img))
    desc = f"{options.num_inputs} seeded N(0,1) images (seed {options.seed}) at {size}"
    if options.images:
        files = image_inputs(options.images, out)
        if files.shape[-2:] != inputs.shape[-2:]:
            raise CheckpointError("image files resolve to another input size than the model's; check the image files")
        inputs = torch.cat([inputs, files])
        desc += f" + {len(options.images)} image file(s)"
    return compare_models(
        ref,
        out,
        inputs,
        reference_name=ref_name,
        model_name=f"{variant.name} (fused_layerscale)" if fused else variant.name,
        family=variant.family,
        inputs_desc=desc,
        batch_size=options.batch_size,
        tolerance=tolerance,
        weights=weights,
        progress=verification_passes,
    )


def verify_checkpoint(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    converted: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    model: str | None = None,
    ema: bool = False,
    options: VerifyOptions | None = None,
) -> ParityReport:
    """Compare the reference model on the original weights with the converted model.

    Both models run in the converted file's float dtype (the source weights are
    cast to it) on ``options.device``, on seeded images at the model's resolution
    plus any image files; every converted tensor is also compared with its source.

    Args:
        source: The original checkpoint (file, URL, ``hf-hub:`` id, or a state dict).
        converted: The converted checkpoint (file or state dict), any layout, folded or not.
        model: Model name overriding detection.
        ema: Take the source's ``'model_ema'`` weights.
        options: Tolerances, inputs and device; the default asks for what the
            family's construction guarantees (:func:`~timm_layerscale.parity.compare.resolve_tolerance`).

    Returns:
        The :class:`~timm_layerscale.parity.compare.ParityReport`.
    """
    if isinstance(source, Mapping):
        src_sd = strip_prefixes(unwrap_state_dict(source))
        variant, info = detect_variant(src_sd, model)
    else:
        _, src_sd, variant, info = load_source(source, model=model, ema=ema)
    if isinstance(converted, Mapping):
        conv_sd = strip_prefixes(unwrap_state_dict(converted))
    else:
        conv_sd = strip_prefixes(unwrap_state_dict(ckpt.load_checkpoint(ckpt.resolve_source(converted))))
    return verify_state_dicts(src_sd, conv_sd, variant, num_classes=info.get("num_classes"), options=options)


def command_line(words: Sequence[Any], options: VerifyOptions | None = None, **opts: Any) -> str:
    """A command line: ``words`` as given, then ``opts`` and the non-default ``options`` as flags.

    A flag's value ``True`` gives a bare flag; ``None``, ``False`` and empty values leave it out.
    """
    parts = [str(w) for w in words]
    if options is not None:
        opts.update(verify_flags(options))
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value not in (None, False, (), []):
            parts += [flag] + ([str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)])
    return shlex.join(parts)


def verify_flags(options: VerifyOptions) -> dict[str, Any]:
    """The non-default verification options as ``{flag_name: value}`` for a command line."""
    default = VerifyOptions()
    flags: dict[str, Any] = {}
    for name in ("exact", "atol", "rtol", "num_inputs", "seed", "images", "device", "batch_size"):
        value = getattr(options, name)
        if value != getattr(default, name):
            flags[name] = list(value) if name == "images" else value
    return flags


def convert_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    model: str | None = None,
    to: str = "ls",
    fmt: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    allow_nonfinite: bool = False,
    ema: bool = False,
    fuse: bool = False,
    options: VerifyOptions | None = None,
    plain: bool = False,
) -> ConversionResult:
    """Convert a checkpoint to the LayerScale-module layout (or back) and verify it.

    With ``verify``, the converted weights (cast to ``dtype``) are compared with the
    source tensor by tensor and the converted model with the reference
    (:func:`verify_state_dicts`) before anything is written; a failed check raises
    :class:`ParityError` and writes nothing. The result goes into the safetensors
    metadata (``parity``: ``bit-exact``, ``within tolerance`` or ``not verified``, with
    the tolerance). The output is written atomically, then read back and compared
    with the verified tensors.

    ``to="gamma"`` writes what the official training code saves: a ``.pth`` file
    holding ``{'model': {'module.' + key: tensor}}`` for CaiT (the official loader
    expects the prefix) and ``{'model': state_dict}`` for DeiT-III and ViT-5, so
    the official code loads it as it is; ``plain=True`` writes the bare state dict
    instead. A safetensors file always holds the bare state dict (timm's own
    layout for its ``cait_*`` Hub copies). A source already in the ``gamma``
    layout is refused for ``to="gamma"``; one already in the ``ls`` layout is
    re-saved for ``to="ls"`` (format, ``dtype`` and ``fuse`` apply).

    Args:
        source: Local file, ``https://`` URL or ``hf-hub:ORG/REPO[/FILE]``.
        output: Output file (``.safetensors`` or ``.pth``).
        model: Model name overriding architecture detection.
        to: Target layout: ``"ls"`` (``ls1.gamma``) or ``"gamma"`` (``gamma_1``).
        fmt: ``"safetensors"`` or ``"pth"``; default from the output's suffix
            (``safetensors`` when it has none of these).
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``; default keeps the source's dtypes.
        overwrite: Replace an existing output.
        verify: Check parity of the written file against the reference.
        allow_nonfinite: Convert even if some tensors hold NaN or Inf.
        ema: Take the source's ``'model_ema'`` weights.
        fuse: Fold every LayerScale gamma into the preceding Linear (``ls`` only);
            the output loads into the model built with ``fused_layerscale=True``.
        options: Verification tolerances, inputs and device.
        plain: With ``to="gamma"``, write a ``.pth`` file without the official wrapper.

    Returns:
        A :class:`ConversionResult`.

    Raises:
        LayerScaleError: Bad options, a source already in the ``gamma`` layout for
            ``to="gamma"``, or any error of reading, detecting or writing.
        ParityError: The written file does not match the reference.
    """
    t0 = time.perf_counter()
    output = Path(output)
    fmt = fmt or ("pth" if output.suffix in (".pth", ".pt", ".bin") else "safetensors")
    if fmt not in ("safetensors", "pth"):
        raise LayerScaleError(f"unknown format {fmt!r}; use 'safetensors' or 'pth'")
    if to not in ("ls", "gamma"):
        raise LayerScaleError(f"unknown target layout {to!r}; use 'ls' or 'gamma'")
    if fuse and to != "ls":
        raise LayerScaleError("fusing applies to the ls layout only; convert to 'ls', or do not fuse")
    if plain and to != "gamma":
        raise LayerScaleError("plain applies to the gamma layout only (an ls file is always plain); leave it out")
    if output.exists() and not overwrite:
        raise OutputExistsError(f"{output} exists; pass overwrite=True to replace it")
    if not output.parent.is_dir():
        raise CheckpointError(f"output folder {output.parent} does not exist; create it first")
    if not os.access(output.parent, os.W_OK):
        raise CheckpointError(f"output folder {output.parent} is not writable; choose another OUTPUT")
    torch_dtype = ckpt.parse_dtype(dtype) if dtype else None

    resolved = ckpt.resolve_source(source)
    identity = ckpt.file_identity(resolved)  # checked once the source is no longer read
    path, sd, variant, info = load_source(resolved, model=model, ema=ema)
    num_classes = info.get("num_classes")
    layout = detect_layout(sd, FAMILIES[variant.family])
    if layout == "gamma" and to == "gamma":
        raise LayerScaleError(
            f"{path.name} is already in the gamma layout; nothing to convert "
            "(convert it to the ls layout, the default, to get ls1.gamma / ls2.gamma)"
        )
    # Without verification, hashing, the NaN/Inf check and (for a plain copy) writing share one read of the file.
    one_pass = None if verify else stream.SourcePass.prepare(path, sd, check=not allow_nonfinite)
    if not allow_nonfinite and one_pass is None:
        ckpt.check_finite(sd)
    target = _to_target(sd, variant, to)
    shapes = target_shapes(variant, num_classes)
    check_state_dict(to_layerscale(target, FAMILIES[variant.family]), shapes, variant.name)
    if fuse:
        from .fold import fold_state_dict

        target = fold_state_dict(to_layerscale(target, FAMILIES[variant.family]))

    copy = one_pass is not None and fmt == "safetensors" and not fuse and one_pass.can_copy(target, torch_dtype)
    sha = ckpt.sha256_file(path) if one_pass is None else None if copy else one_pass.run()
    metadata = {
        "format": "pt",
        "source_file": path.name,
        "source_sha256": sha,
        "source_layout": layout,
        "target_layout": to,
        "architecture": variant.name,
        "family": variant.family,
        "converter": f"timm-layerscale {__version__}",
    }
    if num_classes is not None:
        metadata["num_classes"] = str(num_classes)
    if fuse:
        metadata["fused_layerscale"] = "true"
    wrap = None
    container = "plain"
    if to == "gamma" and fmt == "pth" and not plain:
        family = FAMILIES[variant.family]
        wrap = functools.partial(official_checkpoint, family=family)
        prefix = family.official_prefix
        container = f"{{'model': {{{prefix!r} + key: tensor}}}}" if prefix else "{'model': state_dict}"

    report = None
    if verify:
        if torch_dtype is not None:
            target = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in target.items()}
        report = verify_state_dicts(sd, target, variant, num_classes=num_classes, options=options, fused=fuse)
        if not report.passed:
            what = (
                "converted weights differ from the source" if report.weights_equal is False
                else f"converted model does not match {report.reference} (max abs diff {report.max_abs_diff:.3g}, "
                f"{'bit-exact required' if report.atol == 0 and report.rtol == 0 else f'atol={report.atol:g}, rtol={report.rtol:g}'})"
            )
            raise ParityError(f"{what}; nothing written", report)
        metadata.update(report.metadata())
    else:
        metadata["parity"] = "not verified"
    if copy:
        sha = one_pass.copy_to_safetensors(output, target, metadata, digest_key="source_sha256", overwrite=overwrite)
    else:
        save.save_state_dict(
            output, target, metadata if fmt == "safetensors" else None, fmt=fmt, overwrite=overwrite, dtype=torch_dtype,
            wrap=wrap,
        )
    if verify:
        try:
            written = strip_prefixes(unwrap_state_dict(ckpt.load_checkpoint(output)))
            same, _, detail = compare_weights(target, written)
        except BaseException:
            output.unlink(missing_ok=True)
            raise
        if not same:
            output.unlink(missing_ok=True)
            raise LayerScaleError(f"{output} does not read back as written ({detail}); output removed")
    try:  # the tensors written and verified and the recorded sha256 all come from one version of the file
        ckpt.check_unchanged(path, identity)
    except CheckpointError:
        output.unlink(missing_ok=True)
        raise
    command = command_line(
        ("timm-layerscale", "convert", source, output), options if verify else None, model=model, to=None if to == "ls" else to,
        format=None if fmt == "safetensors" and output.suffix == ".safetensors" else fmt,
        dtype=dtype, overwrite=overwrite or None, no_verify=not verify, allow_nonfinite=allow_nonfinite, ema=ema,
        fuse=fuse, plain=plain,
    )
    return ConversionResult(
        output=output,
        variant=variant,
        num_classes=num_classes,
        source=str(source),
        source_path=path,
        source_sha256=sha,
        source_layout=layout,
        target_layout=to,
        metadata=metadata,
        report=report,
        seconds=time.perf_counter() - t0,
        command=command,
        container=container,
    )


def official_layout(model: nn.Module, family: str = "cait") -> dict[str, Any]:
    """A model's weights as the official training code saves them.

    For CaiT: ``{'model': {'module.' + key: tensor}}`` with ``gamma_1``/``gamma_2``
    (see :func:`~timm_layerscale.conversion.keys.official_checkpoint`).
    """
    return official_checkpoint(to_gamma(model.state_dict(), family), family)


def write_official_checkpoint(
    path: str | os.PathLike, model_name: str = "cait_xxs24_224", seed: int = 0, overwrite: bool = False
) -> nn.Module:
    """Build timm's reference model with seeded weights and save it in the official layout.

    Every parameter is random (:func:`~timm_layerscale.parity.compare.seed_parameters_`,
    gammas of std 0.1), so that a layout or math error shows in the outputs.

    Returns:
        The reference model (eval mode) whose weights were written.
    """
    import timm

    ref = timm.create_model(model_name)
    seed_parameters_(ref, seed)
    with save.atomic_output(path, overwrite) as tmp:
        torch.save(official_layout(ref), tmp)
    return ref.eval()
