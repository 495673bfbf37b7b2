"""The rules of checkpoint conversion, which read and write no file: key mapping between layouts (:mod:`.keys`),
which variant a checkpoint is (:mod:`.detect`), folding LayerScale into the linear layer before it (:mod:`.fold`)."""
