"""Output and weight parity: tolerances, comparison, reports, and the reference models.

- :mod:`.tolerance`: what a check accepts per family and dtype, and :class:`VerifyOptions`;
- :mod:`.inputs`: seeded weights and images;
- :mod:`.compare`: :func:`compare_models`, :func:`compare_weights` and the :class:`ParityReport`;
- :mod:`.verify`: the verification of a conversion;
- :mod:`.references`: the one :func:`~.references.build_reference` per variant;
- :mod:`.vit5_official`: the plain-PyTorch ViT-5 in the official key layout.
"""

from __future__ import annotations

from .compare import ParityReport, attention_path, compare_models, compare_weights
from .inputs import image_inputs, seed_parameters_, seeded_inputs
from .tolerance import EXACT_FAMILIES, FOLDED_TOLERANCE, VIT5_TOLERANCE, Tolerance, VerifyOptions, resolve_tolerance

__all__ = [
    "EXACT_FAMILIES",
    "FOLDED_TOLERANCE",
    "ParityReport",
    "Tolerance",
    "VIT5_TOLERANCE",
    "VerifyOptions",
    "attention_path",
    "compare_models",
    "compare_weights",
    "image_inputs",
    "resolve_tolerance",
    "seed_parameters_",
    "seeded_inputs",
]
