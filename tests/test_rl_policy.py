"""The rl commit policy: recorded steps, the simulator's exact counterfactuals, training on
simulated speed, its file, and decoding with it (lossless)."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, RandomTreeDrafter, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, TreeBudget
from sot.drafters.base import DraftInput, Drafter, DrafterKind
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.policy import PolicyConfig, PolicyKind, RLPolicyModel, load_rl_policy, prune, ranked_nodes
from sot.policy.simulate import accepted_path, from_dict, machine_from_traces, policy_for_replay, replay, within_budget
from sot.sampling import SamplingMode, SamplingParams
from sot.tree import DraftTree, tree_from_parents

NEW = 32


class FreeChainDrafter(RandomTreeDrafter):
    """Random trees, plus a free chain that follows the reference for a random number of
    tokens and then goes wrong (so free drafts are accepted to every depth)."""

    def propose_free(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        out = []
        for x in inputs:
            done = len(x.context) - self.prompt_lengths[x.index]
            ref = self.references[x.index][done:]
            chain = (ref[: self.rng.randint(0, 4)] + [self.rng.randrange(VOCAB)])[: budget.max_depth]
            probs = [1.0] + [0.6 ** (i + 1) for i in range(len(chain))]
            out.append(tree_from_parents([x.context[-1]] + chain, [-1] + list(range(len(chain))), probs))
        return out


class FixedDrafter(Drafter):
    """Proposes ``tree`` once, on the first step, then nothing."""

    kind = DrafterKind.NONE

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        tree, self.tree = self.tree, None
        return [tree or DraftTree.root_only(x.context[-1]) for x in inputs]


def test_simulated_acceptance_equals_what_the_engine_commits() -> None:
    """For logged steps, the accepted length the simulator gives a pruning of the drafted tree,
    a smaller budget of it, or the free draft alone equals what the engine accepts when it
    verifies that tree from the same context."""
    target = TargetModel(clone(tiny_model("llama", seed=4), torch.float32))
    prompts = random_prompts((9, 21), seed=2)
    params = GenerationParams(max_new_tokens=NEW)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = FreeChainDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=5)
    rec = Engine(target, drafter, TreeBudget(12, 5), record_policy=True)
    assert [r.token_ids for r in rec.generate(prompts, params)] == plain, "recording is lossless"
    steps = rec.policy_trace.steps
    assert steps and all(s["batch"] == len(s["seqs"]) for s in steps[:3])
    static = PolicyConfig(kind=PolicyKind.STATIC)
    committed = {0: 1, 1: 1}  # the prompt's pass commits the first token
    checked, nonzero, free_checked = 0, 0, 0
    for step in steps:
        for s in step["seqs"]:
            k = s["key"]
            done = committed[k]
            committed[k] += len(s["target"]) + 1
            if committed[k] + 8 > NEW:
                continue
            assert s["target"] == plain[k][done : done + len(s["target"])], "the logged target tokens are the output's"
            drafted = from_dict(s["drafted"])
            candidates = [drafted, within_budget(drafted, 4, 2, None), prune(drafted, ranked_nodes(drafted)[:2])]
            if s["free"]:
                candidates.append(from_dict(s["free"]))
                free_checked += 1
            context = prompts[k] + plain[k][:done]
            for tree in candidates:
                simulated = len(accepted_path(tree, s["target"])) - 1
                res = Engine(target, FixedDrafter(tree), TreeBudget(32, 8), policy=static).generate(
                    [context[:-1]], GenerationParams(max_new_tokens=12))[0]
                assert res.token_ids[0] == context[-1]
                assert res.accept_lengths[0] - 1 == simulated, (k, done, tree)
                checked += 1
                nonzero += simulated > 0
    assert checked >= 12 and nonzero >= 4 and free_checked >= 3


def _record(target: TargetModel, drafter, prompts, temperature: float = 0.0) -> list[dict]:
    rec = Engine(target, drafter, TreeBudget(10, 4), record_policy=True)
    mode = SamplingMode.COUPLED
    rec.generate(prompts, GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(temperature, seed=1, mode=mode)))
    return rec.policy_trace.steps


def test_rl_policy_trains_on_the_simulator_saves_and_stays_lossless(tmp_path) -> None:
    from sot.drafters.state import StateDrafter, new_predictor
    from sot.fingerprint import embedding_hash
    from sot.train.rl import train_rl

    model = tiny_model("llama", seed=3)
    layers = (0, 1, 2)
    target = TargetModel(clone(model, torch.float32), state_layers=layers)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=3)
    prompts = random_prompts((9, 21, 14, 30), seed=6)
    runs = [_record(target, drafter, prompts[:2]), _record(target, drafter, prompts[2:], 1.0),
            _record(target, drafter, prompts[:1]), _record(target, drafter, prompts[3:])]
    cost = Engine(target, drafter, TreeBudget(10, 4)).cost_model()
    traces = {"runs": runs, "cost_rows": cost.rows, "cost_seconds": cost.seconds, "flat": True}
    machine = machine_from_traces(traces)
    assert machine.pass_seconds > 0
    # an untrained network decides exactly as the heuristic does
    heuristic = replay(policy_for_replay("heuristic"), runs, machine)
    untrained = replay(policy_for_replay("rl", rl=RLPolicyModel()), runs, machine, collect=True)
    assert untrained.tokens == heuristic.tokens and untrained.rows == heuristic.rows
    assert untrained.select and all(s.chosen == s.heuristic for s in untrained.select)
    assert untrained.draft, "the draft-or-free head was asked (and decided as the heuristic)"
    assert all(s.reward.shape[0] == s.features.shape[0] for s in untrained.select)
    # training: a curve, and every policy replayed on the held-out batches
    trained, report = train_rl(traces, epochs=3, held_out=0.25, progress=False)
    assert len(report["history"]) == 3 and report["held_out_batches"] == 1
    assert {"heuristic", "rl"} <= set(report["held_out"][0])
    # file round trip, with the target's fingerprint checked
    path = tmp_path / "rl.safetensors"
    trained.save(path, {"embed_hash": embedding_hash(model.get_input_embeddings().weight)})
    loaded = load_rl_policy(path, target.model)
    x = untrained.select[0]
    assert torch.equal(loaded.select_logits(x.features, x.step), trained.select_logits(x.features, x.step))
    with pytest.raises(ConfigError, match="another target"):
        load_rl_policy(path, tiny_model("llama", seed=9))
    # decoding with it is lossless, alone and in a batch, greedy and coupled sampling
    rl = PolicyConfig(kind=PolicyKind.RL)
    for temperature in (0.0, 1.0):
        params = GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(temperature, seed=2,
                                                                              mode=SamplingMode.COUPLED))
        plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
        out = Engine(target, drafter, TreeBudget(10, 4), policy=rl, rl_model=loaded).generate(prompts, params)
        assert [r.token_ids for r in out] == plain
        plain_alone = Engine(target, NoDrafter()).generate(prompts[1:2], params)[0].token_ids
        alone = Engine(target, drafter, TreeBudget(10, 4), policy=rl, rl_model=loaded).generate(prompts[1:2], params)
        assert alone[0].token_ids == plain_alone


def test_rl_policy_file_errors(tmp_path) -> None:
    target = TargetModel(clone(tiny_model("llama", seed=3), torch.float32), state_layers=(0, 1, 2))
    from sot.drafters.state import StateDrafter, new_predictor

    drafter = StateDrafter(new_predictor(tiny_model("llama", seed=3), (0, 1, 2), None, seed=1), top_k=3)
    with pytest.raises(ConfigError, match="does not exist"):
        Engine(target, drafter, policy=PolicyConfig(kind=PolicyKind.RL, model_path=str(tmp_path / "none")))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a policy")
    with pytest.raises(ConfigError, match="not a commit-policy network of --policy rl"):
        RLPolicyModel.load(bad)
    # plain decoding needs no network
    assert Engine(target, NoDrafter(), policy=PolicyConfig(kind=PolicyKind.RL, model_path="/none")).rl_model is None


@pytest.mark.parametrize("flag,value,message", [("--batch-sizes", "0", "batch sizes"),
                                                ("--temperatures", "a", "comma-separated"),
                                                ("--code-prompts", "-1", "code-prompts")])
def test_train_policy_cli_refuses_bad_settings(tmp_path, capsys, flag, value, message) -> None:
    from sot.cli import main

    assert main(["train", "policy", "--kind", "rl", "--out", str(tmp_path / "rl"), flag, value]) == 2
    assert message in capsys.readouterr().err
