"""The commit policy: cost model, pruning, warm-up, per-sequence fallback with back-off."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, TreeBudget
from sot.drafters.base import DraftInput, Drafter, DrafterKind
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.policy import CostModel, PolicyConfig, PolicyKind, prune, ranked_nodes
from sot.tree import DraftTree, tree_from_parents


def test_cost_model_interpolates_and_never_decreases() -> None:
    cost = CostModel([1, 8, 16], [0.010, 0.009, 0.020])  # a noisy dip at 8 rows
    assert cost.verify(1) == pytest.approx(0.010)
    assert cost.verify(8) == pytest.approx(0.010)
    assert cost.verify(12) == pytest.approx(0.015)
    assert cost.verify(24) > cost.verify(16)


def test_ranked_prefixes_are_closed_under_parents() -> None:
    tree = tree_from_parents([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 3, 1], draft_probs=[1, 0.5, 0.4, 0.45, 0.3, 0.1])
    order = ranked_nodes(tree)
    assert order == [1, 3, 2, 4, 5]
    for n in range(len(order) + 1):
        sub = prune(tree, order[:n])
        assert sub.size == n + 1
        assert all(p < i for i, p in enumerate(sub.parents[1:], start=1))


class _Mixed(Drafter):
    """Sequence 0 gets its true continuation as a confident chain (always accepted);
    sequence 1 gets a confident chain of junk (never accepted)."""

    kind = DrafterKind.PLD

    def __init__(self, references: list[list[int]], prompt_lengths: list[int]) -> None:
        self.references = references
        self.prompt_lengths = prompt_lengths

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        out = []
        for x in inputs:
            if budget.max_nodes < 2:
                out.append(DraftTree([x.context[-1]], [-1], [0]))
            elif x.sequence == 0:
                done = len(x.context) - self.prompt_lengths[0]
                toks = self.references[0][done : done + min(budget.max_depth, budget.max_nodes - 1)]
                out.append(tree_from_parents([x.context[-1], *toks], [-1, *range(len(toks))], [1.0] * (len(toks) + 1)))
            else:
                depth = min(budget.max_depth, budget.max_nodes - 1)
                toks = [(x.context[-1] + 7 * (i + 1)) % VOCAB for i in range(depth)]
                out.append(tree_from_parents([x.context[-1], *toks], [-1, *range(depth)], [1.0] + [0.9] * depth))
        return out


def test_fallback_is_per_sequence_and_lossless() -> None:
    model = tiny_model("llama", seed=2)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((12, 20), seed=4)
    params = GenerationParams(max_new_tokens=60)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = _Mixed(plain, [len(p) for p in prompts])
    # the tiny model's verify time barely grows with rows, so demand a clear gain to speculate
    policy = PolicyConfig(fallback_threshold=1.2, window=3, first_backoff=2)
    res = Engine(target, drafter, TreeBudget(8, 6), policy=policy).generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    good, bad = res
    assert good.fallbacks == 0 and good.mean_accept_len > 3
    assert bad.fallbacks >= 2, "junk drafts should send the sequence to plain decoding, repeatedly"
    assert bad.plain_steps > 0 and bad.tree_sizes.count(1) == bad.plain_steps
    # exponential back-off: later fallbacks last longer, so plain steps outnumber probe steps
    assert bad.plain_steps > sum(1 for n in bad.tree_sizes if n > 1)


def test_static_policy_verifies_the_whole_tree_and_warmup_is_plain() -> None:
    model = tiny_model("llama", seed=2)
    target = TargetModel(clone(model, torch.float32))
    prompts = random_prompts((12,), seed=4)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = _Mixed(plain, [12])
    res = Engine(target, drafter, TreeBudget(8, 6), policy=PolicyConfig(kind=PolicyKind.STATIC, warmup=5)).generate(prompts, params)[0]
    assert res.token_ids == plain[0]
    assert res.tree_sizes[:4] == [1, 1, 1, 1], "tokens 1-4 come from plain steps (token 0 from the prefill)"
    assert res.plain_steps == 4 and res.tree_sizes[4] > 1


def test_policy_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError):
        PolicyConfig(window=0)
    with pytest.raises(ConfigError):
        PolicyConfig(fallback_threshold=-1)
