"""Building blocks in plain PyTorch: the rotary embedding (:mod:`.rope`) and the CPU inference paths of
talking-heads attention (:mod:`.talking_heads`)."""
