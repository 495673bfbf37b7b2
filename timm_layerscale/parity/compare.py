"""Output parity between a reference model and a converted one, and its report.

The reference is the model that computes the released function from the original
weights: timm's ``cait_*`` for the LayerScale CaiT family (timm's CaiT equals the
official code bit for bit with fused attention off), timm's ``deit3_*`` for DeiT-III,
and an independent official-layout implementation for ViT-5. Both models see the
same inputs; the report states how far apart their outputs are, and whether every
converted weight equals its source tensor.

What is asserted follows from how the two sides compute:

* CaiT and DeiT-III: the converted model makes the reference's ATen calls on the same
  operands (the same timm model for DeiT-III; for CaiT a model whose attention is
  checked call for call against timm's), so outputs must be ``torch.equal``.
* ViT-5: the reference is an independent implementation of the same equations, whose
  reductions are ordered differently; outputs must agree within
  :data:`VIT5_TOLERANCE` unless ``exact`` is asked for.
* Folded LayerScale (``fuse``): ``diag(gamma) W`` rounds differently from ``gamma *
  (W x)``, so outputs must agree within :data:`FUSED_TOLERANCE`.
* Weights, always: every converted tensor ``torch.equal`` to its source tensor after
  the requested dtype cast (folded tensors: to the fold of the source), which holds
  on any machine because a cast and a copy round the same way everywhere.
"""
from __future__ import annotations

import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .._version import __version__

__all__ = [
    "ParityReport",
    "VerifyOptions",
    "Tolerance",
    "VIT5_TOLERANCE",
    "FUSED_TOLERANCE",
    "EXACT_FAMILIES",
    "resolve_tolerance",
    "compare_weights",
    "seed_parameters_",
    "seeded_inputs",
    "image_inputs",
    "compare_models",
    "attention_path",
]


#: Families whose converted model makes the reference's kernel calls: outputs must be equal.
EXACT_FAMILIES = ("cait", "deit3")


@dataclass(frozen=True)
class Tolerance:
    """What a parity check accepts: ``|ref - out| <= atol + rtol * |ref|`` everywhere, or equality.

    Attributes:
        atol: Absolute tolerance (0 with ``rtol`` 0: bit-exact).
        rtol: Relative tolerance.
        reason: Why this tolerance applies, for the report.
    """

    atol: float
    rtol: float
    reason: str

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


#: ViT-5 against its independent reference: ``(atol, rtol)`` per dtype.
#: The two implementations order some reductions differently (RMSNorm, the rotary
#: rotation, fused vs. manual attention), so each can differ by a few units of
#: roundoff ``u`` of its result (fp32 ``2**-24``, fp16 ``2**-11``, bf16 ``2**-8``), and the
#: residual stream carries these through the depth: ``|diff| <= c * depth * u * (1 + |y|)``
#: for logits ``y`` of size 1-10. Measured, as the smallest ``t`` with
#: ``|diff| <= t + t * |y|`` (vit5_small and vit5_base, every parameter random, gammas of
#: std 0.1, 8 images, two seeds, manual and fused attention): fp32 2.6e-6, bf16 0.043.
#: The bounds are about 40x (fp32) and 3.5x (bf16) above that; fp16 scales bf16's by
#: its 8x smaller ``u``. A wrong layout (a swapped or unapplied gamma, a missed
#: rotation) moves logits by O(1), far outside them.
VIT5_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (0.15, 0.15),
}

#: A folded model (``diag(gamma) W``) against the unfolded reference: ``(atol, rtol)`` per dtype.
#: Folding rounds each folded weight once more (one ``u``), which moves outputs by a few
#: ``u`` per block as above. Measured on cait_xxs24_224 (random weights, gammas of std
#: 0.1, 8 images): ``t`` = 1.2e-6 fp32, 0.034 bf16; the bounds are 8x and 4x above.
FUSED_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (0.15, 0.15),
}


@dataclass(frozen=True)
class VerifyOptions:
    """How a conversion is verified: the same options for every command that verifies.

    Attributes:
        atol: Absolute tolerance; ``None`` takes the family's default.
        rtol: Relative tolerance; ``None`` takes the family's default.
        exact: Demand bit-exact outputs (``torch.equal``) whatever the family.
        num_inputs: Seeded N(0, 1) images (at least 1).
        seed: Seed of those images.
        images: Image files added to the inputs (timm's eval transforms).
        device: ``"cpu"``, or ``"cuda"`` to run both models on the GPU.
        batch_size: Images per forward pass (at least 1).
    """

    atol: float | None = None
    rtol: float | None = None
    exact: bool = False
    num_inputs: int = 8
    seed: int = 0
    images: tuple[str, ...] = ()
    device: str = "cpu"
    batch_size: int = 4

    def __post_init__(self) -> None:
        from ..errors import LayerScaleError

        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise LayerScaleError(f"{name} must be a finite number >= 0, got {value}")
        if self.exact and (self.atol or self.rtol):
            raise LayerScaleError("exact parity takes no tolerance; drop exact or atol/rtol")
        if self.num_inputs < 1 or self.batch_size < 1:
            raise LayerScaleError("num_inputs and batch_size must be at least 1")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LayerScaleError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        object.__setattr__(self, "images", tuple(self.images))


def resolve_tolerance(family: str, dtype: torch.dtype, options: VerifyOptions, fused: bool = False) -> Tolerance:
    """The tolerance a check applies: ``exact``, else the options', else the family's rule."""
    if options.exact:
        return Tolerance(0.0, 0.0, "exact parity requested")
    if options.atol is not None or options.rtol is not None:
        return Tolerance(options.atol or 0.0, options.rtol or 0.0, "tolerance given by the user")
    if fused:
        atol, rtol = FUSED_TOLERANCE.get(dtype, FUSED_TOLERANCE[torch.float32])
        return Tolerance(atol, rtol, "LayerScale folded into the weights: rounding differs from the reference")
    if family in EXACT_FAMILIES:
        return Tolerance(0.0, 0.0, "bit-exact required: the converted model makes the reference's kernel calls")
    atol, rtol = VIT5_TOLERANCE.get(dtype, VIT5_TOLERANCE[torch.float32])
    return Tolerance(atol, rtol, "the reference is an independent implementation: reductions ordered differently")


def compare_weights(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> tuple[bool, int, str]:
    """Every tensor of ``got`` ``torch.equal`` to the one of ``expected`` (dtype, shape and values).

    Returns:
        ``(equal, compared, detail)``: ``detail`` names the first difference, else ``""``.
    """
    if expected.keys() != got.keys():
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        return False, 0, f"keys differ (missing {missing[:3]}, unexpected {extra[:3]})"
    for key in sorted(expected):
        a, b = expected[key], got[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return False, len(expected), f"{key} differs from its source"
    return True, len(expected), ""


@dataclass
class ParityReport:
    """How closely a converted model reproduces its reference.

    Attributes:
        reference: Name of the reference model.
        model: Name of the converted model.
        family: Model family.
        inputs: What the inputs were.
        num_inputs: Number of input images.
        dtype: dtype of both models and the inputs.
        device: Device both models ran on.
        attention: Attention path both models took.
        max_abs_diff: Largest ``|ref - out|`` over all logits.
        max_rel_diff: Largest ``|ref - out| / |ref|`` (0 where both are 0).
        cosine_min: Smallest per-image cosine similarity of the logit vectors.
        top1_agreement: Fraction of images with the same top-1 class.
        top5_agreement: Fraction of images with the same top-5 class set.
        bit_exact: Every output element is identical (``torch.equal``).
        atol: Absolute tolerance of the check (0 = exact).
        rtol: Relative tolerance of the check (0 = exact).
        tolerance_reason: Why that tolerance applies.
        weights_equal: Every converted tensor equals its source tensor (``None``: not compared).
        weights_compared: Number of tensors compared.
        passed: The check held: the weights are equal (where compared) and the outputs
            bit-exact when both tolerances are 0, else ``|ref - out| <= atol + rtol * |ref|``.
        versions: Package, timm, torch and Python versions.
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
    top1_agreement: float
    top5_agreement: float
    bit_exact: bool
    atol: float
    rtol: float
    passed: bool
    tolerance_reason: str = ""
    weights_equal: bool | None = None
    weights_compared: int = 0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """``"bit-exact"``, ``"within tolerance"`` or ``"failed"``."""
        if not self.passed:
            return "failed"
        return "bit-exact" if self.bit_exact else "within tolerance"

    def metadata(self) -> dict[str, str]:
        """The parity result as string pairs for a safetensors header."""
        return {
            "parity": self.verdict,
            "parity_reference": self.reference,
            "parity_inputs": self.inputs,
            "parity_dtype": self.dtype,
            "parity_max_abs_diff": f"{self.max_abs_diff:.6g}",
            "parity_atol": f"{self.atol:g}",
            "parity_rtol": f"{self.rtol:g}",
            "parity_weights": "equal" if self.weights_equal else "not compared" if self.weights_equal is None else "differ",
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    def _rows(self) -> list[tuple[str, str]]:
        tol = "exact equality" if self.atol == 0 and self.rtol == 0 else f"atol={self.atol:g}, rtol={self.rtol:g}"
        if self.tolerance_reason:
            tol += f" ({self.tolerance_reason})"
        if self.weights_equal is None:
            weights = "not compared"
        else:
            weights = f"{self.weights_compared} tensors {'equal to' if self.weights_equal else 'NOT equal to'} the source"
        return [
            ("weights", weights),
            ("reference", self.reference),
            ("converted", self.model),
            ("inputs", self.inputs),
            ("dtype / device", f"{self.dtype} / {self.device}"),
            ("attention", self.attention),
            ("max abs diff", f"{self.max_abs_diff:.3g}"),
            ("max rel diff", f"{self.max_rel_diff:.3g}"),
            ("min cosine similarity", f"{self.cosine_min:.9f}"),
            ("top-1 agreement", f"{self.top1_agreement:.1%}"),
            ("top-5 agreement", f"{self.top5_agreement:.1%}"),
            ("bit-exact", "yes" if self.bit_exact else "no"),
            ("tolerance", tol),
            ("result", f"PASS ({self.verdict})" if self.passed else "FAIL"),
            ("versions", ", ".join(f"{k} {v}" for k, v in self.versions.items())),
        ]

    def format_table(self) -> str:
        """The report as an aligned two-column plain-text table."""
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_markdown(self) -> str:
        """The report as a markdown table."""
        lines = ["| check | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self._rows()]
        return "\n".join(lines)


def versions() -> dict[str, str]:
    """Versions that decide the numbers: this package, timm, torch, Python."""
    import timm

    return {
        "timm-layerscale": __version__,
        "timm": timm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _is_gamma(name: str) -> bool:
    return name.endswith(("gamma", "gamma_1", "gamma_2"))


@torch.no_grad()
def seed_parameters_(model: nn.Module, seed: int = 0, gamma_std: float = 0.1) -> nn.Module:
    """Fill every parameter and float buffer with seeded random values, in place.

    The values make every branch matter: LayerScale gammas ~ N(0, gamma_std) (not
    the 1e-5 init, which hides differences), matrices ~ N(0, 1/fan_in), norm
    weights ~ 1 + N(0, 0.1), biases and embeddings ~ N(0, 0.1). Values depend only
    on ``seed``, each parameter's name and its shape, so two models whose names map
    onto each other (``gamma_1`` / ``ls1.gamma``) can be filled alike through
    :func:`timm_layerscale.to_layerscale` instead.

    Args:
        model: Any module; parameters on any device and floating dtype.
        seed: Seed of the generator.
        gamma_std: Standard deviation of the LayerScale gammas.

    Returns:
        ``model``.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if _is_gamma(name):
            v = torch.randn(shape, generator=gen) * gamma_std
        elif p.ndim >= 2 and not name.endswith(("pos_embed", "cls_token", "reg_token")):
            fan_in = math.prod(shape[1:])
            v = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        elif name.endswith("weight") and p.ndim == 1:
            v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            v = 0.1 * torch.randn(shape, generator=gen)
        p.copy_(v.to(p.dtype))
    return model


def seeded_inputs(
    num_inputs: int, img_size: int | Sequence[int], seed: int = 0, in_chans: int = 3
) -> torch.Tensor:
    """Seeded N(0, 1) images, the scale of normalised photographs.

    Returns:
        Tensor ``(num_inputs, in_chans, H, W)`` in fp32.
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_inputs, in_chans, h, w, generator=gen)


def image_inputs(paths: Iterable[str], model: nn.Module) -> torch.Tensor:
    """Load image files through timm's data config and eval transforms for ``model``.

    Returns:
        Tensor ``(len(paths), 3, H, W)``.
    """
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from ..errors import CheckpointError

    cfg = resolve_data_config({}, model=model)
    transform = create_transform(**cfg, is_training=False)
    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                out.append(transform(im.convert("RGB")))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read image {p}: {e}") from None
    return torch.stack(out)


def attention_path(model: nn.Module) -> str:
    """Which attention implementation a model's attention layers take."""
    flags = {bool(m.fused_attn) for m in model.modules() if hasattr(m, "fused_attn")}
    if not flags:
        return "manual (softmax(q k^T) v)"
    if flags == {True}:
        return "fused (scaled_dot_product_attention)"
    if flags == {False}:
        return "manual (softmax(q k^T) v)"
    return "mixed: fused where timm fuses, manual talking-heads"


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    reference_name: str,
    model_name: str,
    family: str,
    inputs_desc: str,
    batch_size: int = 4,
    tolerance: Tolerance | None = None,
    weights: tuple[bool, int, str] | None = None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    progress: Callable[[Iterable[torch.Tensor]], Iterable[torch.Tensor]] | None = None,
) -> ParityReport:
    """Run both models on the same inputs and measure how far apart the outputs are.

    Both models are put in eval mode; inputs are cast to the reference's dtype and
    moved to its device.

    Args:
        reference: Model computing the released function from the original weights.
        model: The converted model.
        inputs: Images ``(K, C, H, W)``.
        reference_name, model_name, family, inputs_desc: Labels for the report.
        batch_size: Images per forward pass.
        tolerance: What the check accepts; ``None`` asks for bit-exact equality.
        weights: :func:`compare_weights` of the converted weights against the source, if made.
        forward: ``forward(model, x) -> output``; defaults to ``model(x)``.
        progress: Wraps the iterable of input batches, for a progress bar
            (:func:`timm_layerscale.progress.verification_passes`); default none.

    Returns:
        The :class:`ParityReport`.
    """
    forward = forward or (lambda m, x: m(x))
    reference.eval()
    model.eval()
    p = next(reference.parameters())
    dtype, device = p.dtype, p.device
    outs_ref, outs = [], []
    for chunk in (progress or iter)(inputs.split(batch_size)):
        x = chunk.to(device=device, dtype=dtype)
        outs_ref.append(forward(reference, x).float().cpu())
        outs.append(forward(model, x).float().cpu())
    a = torch.cat(outs_ref)
    b = torch.cat(outs)
    if a.shape != b.shape:
        raise ValueError(f"output shapes differ: reference {tuple(a.shape)}, converted {tuple(b.shape)}")
    diff = (a - b).abs()
    denom = a.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / denom.clamp_min(torch.finfo(torch.float32).tiny))
    a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    cos = torch.nn.functional.cosine_similarity(a2.double(), b2.double(), dim=1)
    bit_exact = all(torch.equal(x, y) for x, y in zip(outs_ref, outs))
    k = min(5, a2.shape[1])
    top1 = (a2.argmax(1) == b2.argmax(1)).float().mean().item()
    top5 = float(
        sum(set(x.tolist()) == set(y.tolist()) for x, y in zip(a2.topk(k, 1).indices, b2.topk(k, 1).indices))
    ) / a2.shape[0]
    tolerance = tolerance or Tolerance(0.0, 0.0, "")
    if tolerance.exact:
        passed = bit_exact
    else:
        passed = bool((diff <= tolerance.atol + tolerance.rtol * denom).all())
    if weights is not None:
        passed = passed and weights[0]
    attn = attention_path(reference)
    if attention_path(model) != attn:
        attn = f"reference: {attn}; converted: {attention_path(model)}"
    return ParityReport(
        reference=reference_name,
        model=model_name,
        family=family,
        inputs=inputs_desc,
        num_inputs=int(inputs.shape[0]),
        dtype=str(dtype).replace("torch.", ""),
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
        weights_equal=None if weights is None else weights[0],
        weights_compared=0 if weights is None else weights[1],
        versions=versions(),
    )
