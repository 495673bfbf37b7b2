"""Output and weight parity: tolerances, comparison, reports, and the reference models.

- :mod:`.tolerance`: what a check accepts per family and dtype, and :class:`VerifyOptions`;
- :mod:`.inputs`: seeded weights and images;
- :mod:`.compare`: :func:`compare_models`, :func:`compare_weights` and the :class:`ParityReport`;
- :mod:`.verify`: the verification of a conversion;
- :mod:`.references`: the one :func:`~.references.build_reference` per variant;
- :mod:`.vit5_official`: the plain-PyTorch ViT-5 in the official key layout.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

_LAZY = {
    "ParityReport": ".compare",
    "VerifyOptions": ".tolerance",
    "Tolerance": ".tolerance",
    "VIT5_TOLERANCE": ".tolerance",
    "FUSED_TOLERANCE": ".tolerance",
    "EXACT_FAMILIES": ".tolerance",
    "resolve_tolerance": ".tolerance",
    "compare_weights": ".compare",
    "seed_parameters_": ".inputs",
    "seeded_inputs": ".inputs",
    "image_inputs": ".inputs",
    "compare_models": ".compare",
    "attention_path": ".compare",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
