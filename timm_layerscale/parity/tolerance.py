"""What a parity check accepts, per family and dtype, and the options of a verification.

CaiT and DeiT-III outputs must be ``torch.equal`` to the reference's: the converted model makes the
reference's ATen calls on the same operands. ViT-5's reference is an independent implementation whose
reductions are ordered otherwise, and a folded model rounds ``diag(gamma) W`` once more: both are held to
the bounds below, derived in the parity guide. Weights are always compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["EXACT_FAMILIES", "FOLDED_TOLERANCE", "VIT5_TOLERANCE", "Tolerance", "VerifyOptions", "resolve_tolerance"]

#: Families whose converted model makes the reference's kernel calls.
EXACT_FAMILIES = ("cait", "deit3")
#: ``(atol, rtol)`` per dtype of ViT-5 against its independent reference: differently ordered reductions
#: through the depth, with a margin (docs/parity.md derives them; fp16's is bf16's over its 8x smaller roundoff).
VIT5_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (0.15, 0.15)}
#: ``(atol, rtol)`` per dtype of a folded model against the unfolded reference (derived in docs/parity.md).
FOLDED_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-2), torch.bfloat16: (0.15, 0.15)}


@dataclass(frozen=True)
class Tolerance:
    """``|ref - out| <= atol + rtol * |ref|`` everywhere, or equality when both are 0; ``reason`` for the report."""

    atol: float
    rtol: float
    reason: str

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


@dataclass(frozen=True)
class VerifyOptions:
    """How a conversion is verified, the same for every command that verifies.

    Attributes:
        atol: Absolute tolerance; ``None``: the family's rule.
        rtol: Relative tolerance; ``None``: the family's rule.
        exact: Demand ``torch.equal`` outputs whatever the family.
        num_inputs: Seeded N(0, 1) images (0 only with ``images``).
        seed: Their seed.
        images: Image files added to the inputs (timm's eval transforms).
        device: ``"cpu"`` or ``"cuda"``.
        batch_size: Images per forward pass.
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
