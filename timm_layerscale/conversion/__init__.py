"""The pure rules of checkpoint conversion between the official ``gamma`` layout and the ``ls`` module layout.

- :mod:`.keys`: key mapping between layouts;
- :mod:`.detect`: which variant a checkpoint is, from its keys and shapes;
- :mod:`.fold`: folding LayerScale into the preceding linear layer.

They read and write no file; :mod:`timm_layerscale.converter` converts and verifies files with them.
"""
