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


def test_walk_answer_reports_the_chains_it_walked() -> None:
    """The walked chains are the walk: one per step, each adding its accepted run plus one."""
    import torch

    from helpers import tiny_model
    from sot.drafters.state import new_predictor
    from sot.train.data import target_states

    model = tiny_model("llama", seed=2)
    pred = new_predictor(model, (0, 1), None, seed=4)
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        states = target_states(model, ids, (0, 1)).float()
        every, tokens, steps, walked = walk_acceptance.walk_answer(pred, states, ids, 12,
                                                                   model.get_output_embeddings().weight, 4)
    assert len(walked) == steps and sum(a + 1 for _, a in walked) == tokens
    assert walked[0][0] == 11 and all(b[0] == a[0] + a[1] + 1 for a, b in zip(walked, walked[1:]))
    assert all(every[r - 11] == a for r, a in walked)
