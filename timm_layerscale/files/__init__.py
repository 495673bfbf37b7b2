"""The file edge: sources (:mod:`.sources`), reading (:mod:`.read`), writing (:mod:`.save`, :mod:`.atomic`)."""
