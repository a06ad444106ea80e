"""Learning from what the engine verifies: recording the target's answers at every committed
position (:mod:`sot.online.record`), the on-policy loss (:mod:`sot.online.loss`) and test-time
adaptation of the state predictor (:mod:`sot.online.adapt`). Importing the package itself
loads nothing heavy (the CLI reads :mod:`sot.online.defaults` before torch is imported)."""
