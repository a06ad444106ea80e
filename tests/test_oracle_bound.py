"""The oracle tree search behind ``python -m sot.analysis.oracle_bound``, checked by brute force."""
from __future__ import annotations

import torch

from helpers import tiny_model
from sot.analysis import oracle_bound
from sot.sampling import SamplingParams, target_probs


@torch.no_grad()
def test_best_tree_gains_equal_the_most_probable_prefixes() -> None:
    """The best tree of ``n`` nodes holds the ``n`` most probable prefixes: for trees of up to 3
    nodes those have depth at most 3, so enumerating every prefix of the top tokens to depth 3
    with full forward passes gives the same expected accepted lengths."""
    oracle = oracle_bound
    model = tiny_model("llama", seed=3)
    params = SamplingParams(temperature=0.05)  # peaked, so the best trees reach below depth 1
    context = torch.tensor([1, 5, 9, 4, 7])
    gains = oracle.best_tree_gains(model, context, params, 3)

    def probs(path: list[int]) -> torch.Tensor:
        ids = torch.cat([context, torch.tensor(path, dtype=torch.long)])
        return target_probs(model(ids[None]).logits[0, -1:].float(), params)[0]

    prefixes: list[tuple[float, int]] = []
    frontier = [([], 1.0)]
    for depth in range(1, 4):
        nxt = []
        for path, base in frontier:
            top = torch.topk(probs(path), 3)
            for p, tok in zip(top.values.tolist(), top.indices.tolist()):
                prefixes.append((base * p, depth))
                nxt.append((path + [tok], base * p))
        frontier = nxt
    best = sorted(prefixes, reverse=True)[:3]
    assert max(d for _, d in best) >= 2, "the check needs a tree deeper than one level"
    expected = [sum(p for p, _ in best[: i + 1]) for i in range(3)]
    assert len(gains) == 3
    assert all(abs(g - e) < 1e-5 for g, e in zip(gains, expected)), (gains, expected)
