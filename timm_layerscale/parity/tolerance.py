"""What a parity check accepts, per model and dtype (both sides compute in fp32), and the options of a verification:
``torch.equal`` where the converted model makes the reference's ATen calls on the same operands; else bounds that grow
with depth, width and the file dtype's roundoff, derived in the parity guide (``docs/parity.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..families import Variant

__all__ = ["TOKENS_FACTOR", "Tolerance", "VerifyOptions", "folded_bound", "independent_bound", "library_bound"]
__all__ += ["resolve_tolerance"]


def independent_bound(depth: int, width: int, dtype: torch.dtype = torch.float32) -> float:
    """``atol = rtol`` of two implementations of one network of ``depth`` blocks of ``width`` channels whose
    reductions are ordered differently, both computing in ``dtype`` of unit roundoff ``u``:
    ``8 * sqrt(depth * log2(4 * width)) * u``. The ``2 * depth`` branches' roundoff differences add with random
    signs, each of blocked sums up to ``4 * width`` long; 8 is over twice the largest error measured."""
    return 8 * math.sqrt(depth * math.log2(4 * width)) * torch.finfo(dtype).eps / 2


def folded_bound(depth: int, width: int, dtype: torch.dtype) -> float:
    """``atol = rtol`` of a model whose ``diag(gamma) W`` was rounded to ``dtype`` once, against the reference on
    ``gamma`` and ``W`` rounded to it apart, both computing in fp32: :func:`independent_bound` at ``dtype``
    times 1.5 / 8 (each weight differs by up to ``u``), plus the fp32 one (``gamma * (W x)`` is not ``(gamma W) x``)."""
    return independent_bound(depth, width, dtype) * 1.5 / 8 + independent_bound(depth, width)


#: The factor on every bound of a family whose check compares every token (``Family.tokens``): the largest of ``n``
#: random roundoff differences grows as ``sqrt(ln n)``, 1.35x from a classifier's 2,000 values to 700,000 tokens.
TOKENS_FACTOR = 1.5


def library_bound(depth: int, width: int) -> float:
    """``atol = rtol`` of this package's or timm's model against another library's (transformers'): twice
    :func:`independent_bound`, since that library also computes the rotary angles by its own formula, one more
    rounding per position and band that reaches every attention logit."""
    return 2 * independent_bound(depth, width)


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
        stream: Run the models one block at a time, each block's weights read from the files as it runs
            (:mod:`~timm_layerscale.parity.stream`); ``None``: where the in-memory path's two fp32 models would need
            more than half the memory available.
    """

    atol: float | None = None
    rtol: float | None = None
    exact: bool = False
    num_inputs: int = 8
    seed: int = 0
    images: tuple[str, ...] = ()
    device: str = "cpu"
    batch_size: int = 4
    stream: bool | None = None

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


def resolve_tolerance(
    variant: Variant, dtype: torch.dtype, options: VerifyOptions, folded: bool = False, independent: bool = False
) -> Tolerance:
    """The tolerance a check of ``variant``'s model on weights of ``dtype`` applies: ``exact``, else the options',
    else the rule of its construction (the bounds above for its depth, counting every block, and width);
    ``independent``: one side is another library's implementation, held to the independent bound."""
    if options.exact:
        return Tolerance(0.0, 0.0, "exact parity requested")
    if options.atol is not None or options.rtol is not None:
        return Tolerance(options.atol or 0.0, options.rtol or 0.0, "tolerance given by the user")
    family = variant.family
    depth = variant.depth + family.extra_blocks
    scale = TOKENS_FACTOR if family.tokens else 1.0
    if folded:
        bound = scale * folded_bound(depth, variant.embed_dim, dtype)
        why = f"LayerScale folded into the weights: rounding to {str(dtype).removeprefix('torch.')} differs from the reference"
        return Tolerance(bound, bound, why)
    if independent:
        bound = scale * library_bound(depth, variant.embed_dim)
        return Tolerance(bound, bound, "another library's implementation: reductions and rotary angles differ")
    if family.exact:
        return Tolerance(0.0, 0.0, "bit-exact required: the converted model makes the reference's kernel calls")
    bound = scale * independent_bound(depth, variant.embed_dim)
    return Tolerance(bound, bound, "the reference is an independent implementation: reductions ordered differently")
