"""Defaults the CLI needs before torch is imported (the one source for both)."""

#: adaptation time as a fraction of the engine's step time (``--adapt-budget``)
ADAPT_BUDGET = 0.10
