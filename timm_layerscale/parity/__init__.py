"""Output and weight parity: tolerances, comparison, reports, and the reference models.

- :mod:`.compare`: tolerances, :class:`VerifyOptions`, :func:`compare_models`, :class:`ParityReport`;
- :mod:`.references`: the one :func:`~.references.build_reference` per variant;
- :mod:`.vit5_official`: the plain-PyTorch ViT-5 in the official key layout.
"""
from __future__ import annotations

from .._lazy import lazy_attributes

_LAZY = {
    "ParityReport": ".compare",
    "VerifyOptions": ".compare",
    "Tolerance": ".compare",
    "VIT5_TOLERANCE": ".compare",
    "FUSED_TOLERANCE": ".compare",
    "EXACT_FAMILIES": ".compare",
    "resolve_tolerance": ".compare",
    "compare_weights": ".compare",
    "seed_parameters_": ".compare",
    "seeded_inputs": ".compare",
    "image_inputs": ".compare",
    "compare_models": ".compare",
    "attention_path": ".compare",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
