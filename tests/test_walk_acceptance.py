"""The chain bookkeeping behind ``python -m sot.analysis.walk_acceptance``, checked by hand and by brute force."""
from __future__ import annotations

import random

from sot.analysis import walk_acceptance


def _chain_runs():
    return walk_acceptance.chain_runs


def test_walk_accepts_runs_and_adds_the_bonus_token() -> None:
    chain_runs = _chain_runs()
    # hits[k][r]: depth k of the chain that starts at row r - k is right
    hits = [[True, True, False, True, True, True, False, False, False],
            [True, False, True, True, True, False, False, False, False],
            [False, True, True, True, False, False, False, False, False]]
    every, tokens, steps = chain_runs(hits, 0, 6, 3)
    # row 0: hits[0][0], then hits[1][1] is False -> 1; row 1: hits[0][1], hits[1][2], hits[2][3] -> 3
    assert every == [1, 3, 0, 2, 1, 1]
    # walk: row 0 accepts 1 (+1 bonus) -> row 2 accepts 0 (+1) -> row 3 accepts 2 (+1) -> row 6 ends it
    assert (tokens, steps) == (2 + 1 + 3, 3)


def test_walk_matches_a_step_by_step_decode() -> None:
    """Against a plain simulation of greedy decoding with a fixed chain: each step drafts
    ``depth`` tokens from the current row and commits the accepted prefix plus one."""
    chain_runs = _chain_runs()
    rng = random.Random(0)
    for _ in range(50):
        depth, stop = rng.randint(1, 5), rng.randint(1, 40)
        hits = [[rng.random() < 0.7 for _ in range(stop + depth)] for _ in range(depth)]

        def drafted(pos: int) -> int:
            accepted = 0
            for k in range(depth):
                if not hits[k][pos + k]:
                    break
                accepted += 1
            return accepted

        pos, tokens, steps = 0, 0, 0
        while pos < stop:
            accepted = drafted(pos)
            pos, tokens, steps = pos + accepted + 1, tokens + accepted + 1, steps + 1
        every, got_tokens, got_steps = chain_runs(hits, 0, stop, depth)
        assert (got_tokens, got_steps) == (tokens, steps)
        assert every == [drafted(r) for r in range(stop)]
