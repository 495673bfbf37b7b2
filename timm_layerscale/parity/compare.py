"""Output parity between a reference and a converted model, and the report of it and of the weight checks."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .._version import __version__
from .tolerance import Tolerance

__all__ = ["ParityReport", "attention_path", "compare_models", "versions"]


@dataclass
class ParityReport:
    """How closely a converted model reproduces its reference.

    Attributes:
        reference, model, family, inputs: What was compared on what.
        num_inputs, dtype, device, attention: The images, the converted weights' dtype, device and attention.
        max_abs_diff: Largest ``|ref - out|`` over all outputs (logits, or a backbone's features).
        max_rel_diff: Largest ``|ref - out| / |ref|`` (0 where both are 0).
        cosine_min: Smallest per-image cosine similarity of the outputs.
        top1_agreement, top5_agreement: Fractions of images with the same top-1 class and top-5 set;
            ``None`` for a model without a classifier.
        bit_exact: Every output element is identical (NaN or Inf where the reference has the same).
        atol, rtol, tolerance_reason: The check's tolerance (both 0: bit-exact) and why it applies.
        weights_equal, weights_compared: Every tensor of the converted file equals the source's (``None``: not
            compared); how many. ``dropped``: the source's keys the conversion drops or takes apart, by name.
        passed: The outputs are within the tolerance and the weights equal (where compared).
        compute_dtype, versions: What both models computed in; this package's, timm's, torch's, Python's versions.
        seconds: Wall seconds of each model's forward passes (``reference``, ``converted model``; verify adds loading).
        path: How the models held their weights: ``"in memory"``, or ``"one block at a time"`` (each block's read from
            the files as it ran).
    """

    reference: str
    model: str
    family: str
    inputs: str
    num_inputs: int
    dtype: str
    device: str
    attention: str
    max_abs_diff: float
    max_rel_diff: float
    cosine_min: float
    top1_agreement: float | None
    top5_agreement: float | None
    bit_exact: bool
    atol: float
    rtol: float
    passed: bool
    tolerance_reason: str = ""
    weights_equal: bool | None = None
    weights_compared: int = 0
    weights_detail: str = ""
    dropped: str = ""
    compute_dtype: str = "float32"
    versions: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    path: str = "in memory"

    def add_weights(self, equal: bool, compared: int, dropped: str = "", detail: str = "") -> None:
        """Record the weight comparison: every one of ``compared`` tensors equal, or not (the check then fails, its
        first difference ``detail``), and the source keys ``dropped``."""
        self.weights_equal, self.weights_compared, self.dropped = equal, compared, dropped
        self.weights_detail = detail
        self.passed = self.passed and equal

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "failed"
        return "bit-exact" if self.bit_exact else "within tolerance"

    def metadata(self) -> dict[str, str]:
        """The result as string pairs for a safetensors header."""
        return {
            "parity": self.verdict,
            "parity_reference": self.reference,
            "parity_inputs": self.inputs,
            "parity_dtype": self.dtype,
            "parity_max_abs_diff": f"{self.max_abs_diff:.6g}",
            "parity_atol": f"{self.atol:g}",
            "parity_rtol": f"{self.rtol:g}",
            "parity_weights": {True: "equal", False: "differ", None: "not compared"}[self.weights_equal],
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _rows(self) -> list[tuple[str, str]]:
        tol = "exact equality" if self.atol == 0 and self.rtol == 0 else f"atol={self.atol:g}, rtol={self.rtol:g}"
        if self.tolerance_reason:
            tol += f" ({self.tolerance_reason})"
        weights = f"{self.weights_compared} tensors of the converted file {'equal to' if self.weights_equal else 'NOT all equal to'} the source's"
        weights += f" ({self.weights_detail})" if self.weights_detail else ""
        return [
            ("weights", "not compared" if self.weights_equal is None else weights),
            *((("dropped / split", self.dropped),) if self.dropped else ()),
            ("reference", self.reference),
            ("converted", self.model),
            ("inputs", self.inputs),
            ("dtype / device", f"{self.dtype} weights, computed in {self.compute_dtype} / {self.device}"),
            ("attention", self.attention),
            ("weights held", self.path),
            ("max abs diff", f"{self.max_abs_diff:.3g}"),
            ("max rel diff", f"{self.max_rel_diff:.3g}"),
            ("min cosine similarity", f"{self.cosine_min:.9f}"),
            *(
                (f"top-{k} agreement", "- (no classifier)" if v is None else f"{v:.1%}")
                for k, v in ((1, self.top1_agreement), (5, self.top5_agreement))
            ),
            ("bit-exact", "yes" if self.bit_exact else "no"),
            ("tolerance", tol),
            ("result", f"PASS ({self.verdict})" if self.passed else "FAIL"),
            ("versions", ", ".join(f"{k} {v}" for k, v in self.versions.items())),
        ]

    def format_table(self) -> str:
        """The report as an aligned two-column table."""
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_markdown(self) -> str:
        lines = ["| check | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self._rows()]
        return "\n".join(lines)


def versions() -> dict[str, str]:
    """The versions that decide the numbers: this package's, timm's, torch's, Python's."""
    import timm

    return {
        "timm-layerscale": __version__,
        "timm": timm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def attention_path(model: nn.Module) -> str:
    """Which attention implementation a model's attention layers take."""
    flags = {bool(m.fused_attn) for m in model.modules() if hasattr(m, "fused_attn")}
    if not any(hasattr(m, "num_heads") or hasattr(m, "num_attention_heads") for m in model.modules()):  # timm's, HF's
        return "none (the model has no attention)"
    if flags == {True}:
        return "fused (scaled_dot_product_attention)"
    return "mixed: fused where the layer fuses, manual in the others" if len(flags) > 1 else "manual"


def _flipped(refs: list[torch.Tensor], outs: list[torch.Tensor], tol: Tolerance, top1: float | None) -> bool:
    """Whether a class logit output changed its top-1 class on an input whose reference margin between its two
    largest logits exceeds twice the bound on one logit (``atol + rtol * |logit|``): no error within the tolerance
    can swap those two, so a swap is a wrong weight the tolerance let through."""
    if top1 is None or top1 == 1.0 or refs[0].shape[1] < 2:  # no classes (tokens), or none changed
        return False
    a, b = torch.cat(refs), torch.cat(outs)
    top2 = a.topk(2, dim=1).values
    margin = top2[:, 0] - top2[:, 1]
    clear = margin > 2 * (tol.atol + tol.rtol * top2.abs().max(dim=1).values)
    return bool((clear & (a.argmax(1) != b.argmax(1))).any())


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    reference_name: str,
    model_name: str,
    family: str,
    inputs_desc: str,
    batch_size: int = 4,
    tolerance: Tolerance | None = None,
    weights_dtype: str | None = None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    progress: Callable[[Iterable[torch.Tensor]], Iterable[torch.Tensor]] | None = None,
    run: Callable[[nn.Module, list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> ParityReport:
    """Run both models (in eval mode) on ``inputs`` ``(K, C, H, W)`` (or several such batches, one per input size),
    cast to the reference's dtype and device, ``batch_size`` at a time, and measure how far apart their outputs are.

    Args:
        reference: The model that computes the released function from the original weights.
        model: The converted model.
        inputs: The images.
        reference_name, model_name, family, inputs_desc: Labels of the report.
        batch_size: Images per forward pass.
        tolerance: What the check accepts; ``None``: bit-exact equality.
        weights_dtype: The converted weights' dtype, for the report (default the models').
        forward: ``forward(model, x)``; default ``model(x)``.
        progress: Wraps the batches, for a progress bar.
        run: ``run(model, batches)``: a model's fp32 CPU outputs on one input group's batches (default ``forward``
            on one batch after another).
    """
    forward = forward or (lambda m, x: m(x))
    reference.eval()
    model.eval()
    p = next(reference.parameters())
    dtype, device = p.dtype, p.device
    groups = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    chunks = [[c.to(device=device, dtype=dtype) for c in g.split(batch_size)] for g in groups]

    def each(m: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [forward(m, x).float().cpu() for x in (progress or iter)(batches)]

    outs_ref: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    seconds = [0.0, 0.0]
    for i, (m, got) in enumerate(((reference, outs_ref), (model, outs))):
        t0 = time.perf_counter()
        for batches in chunks:
            got += (run or each)(m, batches)
        seconds[i] = time.perf_counter() - t0
    for a, b in zip(outs_ref, outs, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"output shapes differ: reference {tuple(a.shape)}, converted {tuple(b.shape)}")
    # each image's output flattened, so that outputs of several input sizes (token counts) line up
    a, b = (torch.cat([o.reshape(-1) for o in group]) for group in (outs_ref, outs))
    same = torch.isclose(b, a, rtol=0.0, atol=0.0, equal_nan=True)  # NaN or Inf in both (allow_nonfinite)
    diff = torch.where(same, 0.0, (a - b).abs())
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / a.abs().clamp_min(torch.finfo(torch.float32).tiny))
    cos = torch.cat(
        [
            torch.nn.functional.cosine_similarity(
                x.reshape(x.shape[0], -1).double(), y.reshape(y.shape[0], -1).double()
            )
            for x, y in zip(outs_ref, outs, strict=True)
        ]
    )
    bit_exact = bool(same.all())
    top1 = top5 = None
    if getattr(model, "num_classes", None) != 0 and outs_ref[0].ndim == 2:  # a backbone's tokens are no classes
        a2, b2 = torch.cat(outs_ref), torch.cat(outs)
        k = min(5, a2.shape[1])
        top1 = (a2.argmax(1) == b2.argmax(1)).float().mean().item()
        pairs = zip(a2.topk(k, 1).indices, b2.topk(k, 1).indices, strict=True)
        top5 = sum(set(x.tolist()) == set(y.tolist()) for x, y in pairs) / a2.shape[0]
    tolerance = tolerance or Tolerance(0.0, 0.0, "")
    close = bit_exact or bool(torch.isclose(b, a, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True).all())
    passed = bit_exact if tolerance.exact else close and not _flipped(outs_ref, outs, tolerance, top1)
    attn = attention_path(reference)
    if attention_path(model) != attn:
        attn = f"reference: {attn}; converted: {attention_path(model)}"
    return ParityReport(
        reference=reference_name,
        model=model_name,
        family=family,
        inputs=inputs_desc,
        num_inputs=sum(int(g.shape[0]) for g in groups),
        dtype=weights_dtype or str(dtype).replace("torch.", ""),
        device=str(device),
        attention=attn,
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        max_rel_diff=float(rel.max()) if rel.numel() else 0.0,
        cosine_min=float(cos.min()),
        top1_agreement=top1,
        top5_agreement=top5,
        bit_exact=bit_exact,
        atol=float(tolerance.atol),
        rtol=float(tolerance.rtol),
        passed=passed,
        tolerance_reason=tolerance.reason,
        compute_dtype=str(dtype).replace("torch.", ""),
        versions=versions(),
        seconds={"reference": seconds[0], "converted model": seconds[1]},
    )
