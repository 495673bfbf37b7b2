"""The weight checks of a conversion: the written file, read back, against the source's tensors mapped by the
rules and cast as asked; a folded file's weights against ``gamma * W`` computed apart; and the error a failed
check raises."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from ..conversion.detect import Detection
from ..conversion.fold import fold_gates
from ..conversion.rules import Change, cast_tensors, describe_changes, target_tensors
from ..errors import ParityError
from ..families import Family, Layout
from ..files.read import Source, read_state_dict
from .compare import ParityReport

__all__ = ["check_folds", "check_written", "compare_files", "compare_weights", "parity_error"]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, a NaN matching a NaN in the same place (a weight converted with ``allow_nonfinite``)."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all())


def compare_weights(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> tuple[bool, int, str]:
    """``(equal, compared, detail)``: whether every tensor of ``got`` equals ``expected``'s (dtype, shape, values),
    how many were compared, and the first difference."""
    if expected.keys() != got.keys():
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        return False, 0, f"keys differ (missing {missing[:3]}, unexpected {extra[:3]})"
    for key in sorted(expected):
        a, b = expected[key], got[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            return (
                False,
                len(expected),
                f"{key} is {b.dtype} {list(b.shape)} where the source's is {a.dtype} {list(a.shape)}",
            )
        if not _equal(a, b):
            if not a.is_floating_point():
                return False, len(expected), f"{key} differs from its source"
            by = float((a.double() - b.double()).abs().nan_to_num(nan=math.inf).max())
            return False, len(expected), f"{key} differs from its source by up to {by:.3g}"
    return True, len(expected), ""


def parity_error(report: ParityReport, weights: str | None = None) -> ParityError:
    """The error of a failed check: the outputs, or with ``weights`` (the first difference) the written file."""
    needed = "bit-exact required" if report.atol == report.rtol == 0 else f"atol={report.atol:g}, rtol={report.rtol:g}"
    what = f"converted model does not match {report.reference} (max abs diff {report.max_abs_diff:.3g}, {needed})"
    what = f"the written file differs from the source ({weights})" if weights else what
    return ParityError(f"{what}; nothing written", report)


def compare_files(
    tensors: Mapping[str, torch.Tensor],
    found: Detection,
    to: Layout,
    fold: bool,
    dtype: torch.dtype | None,
    written: Mapping[str, torch.Tensor],
    container: tuple[str | None, str] | None,
    report: ParityReport,
    meaning: bool = False,
) -> str:
    """The one weight comparison, recorded in ``report``: the ``written`` tensors (in ``to``, in ``container`` unless
    ``None``) against the source's ``tensors`` mapped by the rules and cast as requested, and a folded file's weights
    against ``gamma * W`` computed apart; the first difference, or ``''``. With ``meaning`` (two files of one model,
    not a file and the conversion that wrote it) both sides are read into the ``ls`` layout by their own layouts'
    rules, so that what either drops or synthesises is proven inert on its own values (a stored ``periods`` equal to
    the computed ones within its rounding, a masked k third) and the rest compared."""
    variant, ls = found.variant, found.variant.family.layouts["ls"]
    changes: list[Change] = []
    unfolded = target_tensors(tensors, variant, found.layout, ls if meaning else to, changes=changes)
    # folding is for the ls layout only
    expected = fold_gates(unfolded, variant.family, dtype) if fold else unfolded
    got = target_tensors(written, variant, to, ls) if meaning else written
    # the request, not the cast that was made
    same, count, detail = compare_weights(cast_tensors(expected, dtype, to.computed(variant)), got)
    if same and container is not None and container != (to.wrapper, to.prefix):
        same, detail = False, f"its container is not {to.container}"
    if same and fold:
        detail = check_folds(unfolded, got, variant.family)
        same = not detail
    report.add_weights(same, count, describe_changes(changes), detail)
    return detail


def check_written(
    written: Path, src: Source, to: Layout, fold: bool, dtype: torch.dtype | None, report: ParityReport
) -> None:
    """The written file, read back, against the source file's tensors read on their own
    (:func:`compare_files`); a difference is a :class:`~timm_layerscale.errors.ParityError` (the file is not kept)."""
    tensors = read_state_dict(src.path, src.ema)[0]
    got, container = read_state_dict(written)
    stored = None if written.suffix == ".safetensors" else container
    if detail := compare_files(tensors, src.detection, to, fold, dtype, got, stored, report):
        raise parity_error(report, detail)


def check_folds(ls: Mapping[str, torch.Tensor], folded: Mapping[str, torch.Tensor], family: Family) -> str:
    """The first weight of a ``folded`` state dict that is not ``gamma * W`` of the unfolded ``ls`` one (of
    ``family``) computed apart in float64 (exact for fp32, bf16 and fp16 factors) and rounded once to the folded
    dtype (``''``: none), so that a fold rule that changes one gate's scale is seen where it moves a single weight by
    one unit in the last place."""
    for key, gamma in ls.items():
        found = family.gate_of(key)
        if found is None:
            continue
        target = f"{found[0]}.{found[1].fold}"
        for part in ("weight", "bias"):
            if (source := ls.get(f"{target}.{part}")) is None:
                continue
            got = folded[f"{target}.{part}"]
            exact = (source.double() * gamma.double().reshape(-1, *[1] * (source.ndim - 1))).to(got.dtype)
            if not _equal(got, exact):
                return f"{target}.{part} is not gamma * W rounded once"
    return ""
