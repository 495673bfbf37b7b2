"""What a parity check accepts, per family and dtype, and the options of a verification.

What is asserted follows from how the two sides compute:

* CaiT and DeiT-III: the converted model makes the reference's ATen calls on the same
  operands (the same timm model for DeiT-III; for CaiT a model whose attention is
  checked call for call against timm's), so outputs must be ``torch.equal``.
* ViT-5: the reference is an independent implementation of the same equations, whose
  reductions are ordered differently; outputs must agree within
  :data:`VIT5_TOLERANCE` unless ``exact`` is asked for.
* Folded LayerScale (``fold``): ``diag(gamma) W`` rounds differently from ``gamma *
  (W x)``, so outputs must agree within :data:`FOLDED_TOLERANCE`.
* Weights, always: every converted tensor ``torch.equal`` to its source tensor after
  the requested dtype cast (folded tensors: to the fold of the source), which holds
  on any machine because a cast and a copy round the same way everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "VIT5_TOLERANCE", "FOLDED_TOLERANCE", "EXACT_FAMILIES", "VerifyOptions", "resolve_tolerance"]


#: Families whose converted model makes the reference's kernel calls, so outputs must be equal.
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


#: ViT-5 against its independent reference, ``(atol, rtol)`` per dtype.
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

#: A folded model (``diag(gamma) W``) against the unfolded reference, ``(atol, rtol)`` per dtype.
#: Folding rounds each folded weight once more (one ``u``), which moves outputs by a few
#: ``u`` per block as above. Measured on cait_xxs24_224 (random weights, gammas of std
#: 0.1, 8 images): ``t`` = 1.2e-6 fp32, 0.034 bf16; the bounds are 8x and 4x above.
FOLDED_TOLERANCE = {
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
        num_inputs: Seeded N(0, 1) images (0 only with ``images``).
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
        from ..errors import LayerScaleError, option

        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise LayerScaleError(f"{name} must be a finite number >= 0, got {value}")
        if self.exact and (self.atol or self.rtol):
            raise LayerScaleError(f"exact parity takes no tolerance; drop {option('exact')} or the tolerances")
        if self.num_inputs < 0 or self.batch_size < 1:
            raise LayerScaleError("num_inputs must be at least 0 and batch_size at least 1")
        if not -(2**63) <= self.seed < 2**64:
            raise LayerScaleError(f"seed must be from -2**63 to 2**64 - 1 (the seeds torch takes), got {self.seed}")
        if self.num_inputs == 0 and not self.images:
            raise LayerScaleError(f"{option('num_inputs', 0)} leaves no inputs; pass image files too")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LayerScaleError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        object.__setattr__(self, "images", tuple(self.images))


def resolve_tolerance(family: str, dtype: torch.dtype, options: VerifyOptions, folded: bool = False) -> Tolerance:
    """The tolerance a check applies: ``exact``, else the options', else the family's rule."""
    if options.exact:
        return Tolerance(0.0, 0.0, "exact parity requested")
    if options.atol is not None or options.rtol is not None:
        return Tolerance(options.atol or 0.0, options.rtol or 0.0, "tolerance given by the user")
    if folded:
        atol, rtol = FOLDED_TOLERANCE.get(dtype, FOLDED_TOLERANCE[torch.float32])
        return Tolerance(atol, rtol, "LayerScale folded into the weights: rounding differs from the reference")
    if family in EXACT_FAMILIES:
        return Tolerance(0.0, 0.0, "bit-exact required: the converted model makes the reference's kernel calls")
    atol, rtol = VIT5_TOLERANCE.get(dtype, VIT5_TOLERANCE[torch.float32])
    return Tolerance(atol, rtol, "the reference is an independent implementation: reductions ordered differently")
