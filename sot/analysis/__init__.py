"""Studies of the engine, runnable with ``python -m``: the acceptance that 2x needs on this
machine (:mod:`~sot.analysis.break_even`), the best trees the target could verify
(:mod:`~sot.analysis.oracle_bound`), and chain walks of a predictor over the target's own
answers (:mod:`~sot.analysis.walk_acceptance`). Their figures are in ``docs/RESULTS.md``."""
