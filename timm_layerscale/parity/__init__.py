"""Output and weight parity: tolerances (:mod:`.tolerance`), inputs (:mod:`.inputs`), comparison and its
report (:mod:`.compare`), the references (:mod:`.references`) and the verification
of a conversion (:mod:`.verify`)."""
