"""Checkpoint conversion between the official ``gamma`` layout and the ``ls`` module layout.

One concern per module, pure rules in the middle and I/O at the edges:

- :mod:`.families`: what each model family is (key rules, variants, rotary tables);
- :mod:`.keys`: pure key mapping between layouts;
- :mod:`.detect`: which variant a checkpoint is, from its keys and shapes;
- :mod:`.fold`: folding LayerScale into the preceding linear layer;
- :mod:`.io`: reading checkpoints and resolving sources;
- :mod:`.save`: atomic, streaming writes;
- :mod:`.atomic`: writers' temporary files, publishing them, and cleaning up after killed ones;
- :mod:`.pipeline`: convert and verify, end to end.

The names below are imported on first use, so importing this package loads no torch.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

_LAZY = {
    "ConversionResult": ".pipeline",
    "convert_checkpoint": ".pipeline",
    "verify_checkpoint": ".pipeline",
    "load_source": ".pipeline",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
