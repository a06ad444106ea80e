"""The chain arithmetic behind ``python -m sot.analysis.break_even``."""
from __future__ import annotations

import math

import pytest

from sot.analysis import break_even


def test_chain_speed_counts_committed_tokens_against_the_step_cost() -> None:
    be = break_even
    verify = {1: 10.0, 2: 12.0, 3: 15.0}.__getitem__
    # a chain of 2 at acceptance 0.5: 1 + 0.5 + 0.25 tokens for a 3-row pass plus 2 draft passes
    assert be.chain_speed(0.5, 2, verify, 1.0) == pytest.approx(1.75 * 10.0 / 17.0)
    assert be.chain_speed(1.0, 1, verify, 0.0) == pytest.approx(2 * 10.0 / 12.0)


def test_required_acceptance_reaches_the_target_at_its_depth_and_no_lower() -> None:
    be = break_even

    def verify(rows: int) -> float:  # flat up to 4 rows, then a step, like a register tile
        return 1.0 if rows <= 4 else 1.0 + 0.3 * (rows - 4)

    a, depth = be.required_acceptance(2.0, verify, 0.05)
    assert 0 < a < 1 and depth >= 1
    assert be.chain_speed(a, depth, verify, 0.05) == pytest.approx(2.0, rel=1e-6)
    for d in range(1, 13):  # no depth reaches 2x with a slightly lower acceptance
        assert be.chain_speed(a - 1e-3, d, verify, 0.05) < 2.0
    # dearer drafting needs better acceptance; free drafting on a flat curve needs a = 1/2 in the limit
    assert be.required_acceptance(2.0, verify, 0.2)[0] > a
    flat, _ = be.required_acceptance(2.0, lambda rows: 1.0, 0.0, max_depth=60)
    assert flat == pytest.approx(0.5, abs=1e-3)
    assert be.best_speed(a, verify, 0.05) == pytest.approx((2.0, depth), rel=1e-6)


def test_required_acceptance_reports_a_target_out_of_reach() -> None:
    be = break_even
    a, depth = be.required_acceptance(3.0, lambda rows: float(rows), 0.0, max_depth=5)
    assert math.isinf(a) and depth == 0
