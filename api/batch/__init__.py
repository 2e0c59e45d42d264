"""The batch API: the file store (:mod:`~api.batch.store`), a batch input's lines
(:mod:`~api.batch.lines`), one batch job and its status transitions
(:mod:`~api.batch.job`) and the runner (:mod:`~api.batch.runner`), which answers each
line through its endpoint's handler (:mod:`api.endpoints`)."""
