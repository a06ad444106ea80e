"""Learning from the verify passes: what the recorder keeps, the on-policy loss and stage,
and test-time adaptation (lossless, rolled back when it hurts, within its time budget)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers import clone, random_prompts, tiny_model
from state_helpers import LAYERS, conversations
from sot.drafters import NoDrafter, TreeBudget, make_drafter
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel, transformers_attention
from sot.online.adapt import AdaptConfig, Adapter
from sot.online.loss import OnlineLossConfig, chain_weights, online_loss, sparse_cross_entropy
from sot.online.record import NodeRecorder, OnPolicySequence
from sot.policy import PolicyConfig, PolicyKind
from sot.sampling import SamplingMode, SamplingParams

STATIC = PolicyConfig(kind=PolicyKind.STATIC)


def _record(target, drafter, prompts, params, policy=None):
    rec = NodeRecorder(2, top_k=8)
    engine = Engine(target, drafter, TreeBudget(13, 4), trace=True, policy=policy, observers=[rec])
    results = engine.generate(prompts, params)
    by_prompt = {s.prompt_len: s for s in rec.take()}
    return results, [by_prompt[len(p)] for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recorded_nodes_equal_what_the_verify_passes_computed(dtype: torch.dtype) -> None:
    model = clone(tiny_model("llama"), dtype)
    layers = (0, 1)  # the target's final state (layer 2) is the extra one
    target = TargetModel(model, state_layers=layers + (2,))
    prompts = random_prompts((9, 23, 41), seed=4)
    params = GenerationParams(max_new_tokens=24)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=3), top_k=3, lookup=False)
    spec, recorded = _record(target, drafter, prompts, params, STATIC)
    plain, plain_rec = _record(target, NoDrafter(), prompts, params)
    for p, r, s, ps in zip(prompts, spec, recorded, plain_rec):
        assert r.token_ids == plain[prompts.index(p)].token_ids
        assert s.tokens.tolist() == (p + r.token_ids)[: s.length]
        assert s.length == len(p) + r.new_tokens - 1  # the last token is never read
        # the distribution behind every committed token is the verify pass's logits row
        rows = torch.stack(r.logit_trace)[: s.length - len(p) + 1]
        logp = torch.log_softmax(rows.float(), dim=-1)
        got = s.top_logp[len(p) - 1 :]
        assert torch.equal(logp.gather(-1, s.top_ids[len(p) - 1 :].long()), got)
        assert torch.equal(logp.topk(8, dim=-1).values, got)
        assert (s.top_ids[: len(p) - 1] == -1).all()
        # states: rows are computed independently of the tree, so the speculative run's recorded
        # states equal plain decoding's bit for bit; the final state is the target's last norm
        assert torch.equal(s.states, ps.states) and s.states.shape[1:] == (2, model.config.hidden_size)
        assert torch.equal(s.final, ps.final)
        assert s.final.shape == (s.length, model.config.hidden_size)
        if dtype == torch.float32:  # the last layer's state is transformers' (after the final norm)
            with torch.no_grad(), transformers_attention(model):
                want = model(s.tokens[None].long(), output_hidden_states=True).hidden_states[2][0]
            assert torch.allclose(s.final.float(), want.bfloat16().float(), rtol=0.02, atol=0.02)
        # one chain per drafted step (static: every step after the prompt), as the result counts it
        assert s.chains.shape[0] == r.steps
        assert s.chains[:, 1].tolist() == [n - 1 for n in r.accept_lengths]
        assert (s.chains[:, 0] >= len(p) - 1).all() and (s.chains[:, 1] <= s.chains[:, 2]).all()
        assert ps.chains.shape[0] == 0


def _sequence(length: int = 20, prompt: int = 6, k: int = 5, vocab: int = 96, chains=()) -> OnPolicySequence:
    gen = torch.Generator().manual_seed(length)
    logits = torch.randn(length, vocab, generator=gen)
    ids = logits.topk(k, dim=-1).indices.to(torch.int32)
    logp = torch.log_softmax(logits, -1).gather(-1, ids.long())
    ids[: prompt - 1] = -1
    return OnPolicySequence(torch.randint(0, vocab, (length,), generator=gen),
                            torch.randn(length, len(LAYERS), 64, generator=gen).bfloat16(), None, ids, logp, prompt,
                            torch.tensor(chains, dtype=torch.int32).reshape(-1, 3))


def test_chain_weights_are_fits_rows_plus_the_chains_and_their_errors() -> None:
    cfg = OnlineLossConfig(unroll=3, uniform=1.0, error_weight=2.0)
    plain = chain_weights(_sequence(), cfg)
    assert plain.shape == (3, 19)
    for k in range(3):  # fit's rows: every row whose target is an answer position, from step k on
        assert plain[k].tolist() == [1.0 if t >= max(k, 5) else 0.0 for t in range(19)]
    w = chain_weights(_sequence(chains=[(7, 1, 4)]), cfg)
    assert w[0, 7] == 2.0 and w[1, 8] == 1.0 + 1.0 + 2.0 and w[2, 9] == 2.0  # step 1 is where it failed
    assert torch.equal(w - plain, torch.zeros_like(w).index_put_((torch.tensor([0, 1, 2]), torch.tensor([7, 8, 9])),
                                                                 torch.tensor([1.0, 3.0, 1.0])))


def test_sparse_cross_entropy_is_the_dense_one_when_the_top_k_is_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    target, draft = torch.randn(4, 12, generator=gen), torch.randn(4, 12, generator=gen)
    logp = torch.log_softmax(target, -1)
    vals, ids = logp.topk(12, dim=-1)
    ce, ent = sparse_cross_entropy(draft, ids, vals)
    dense = -(logp.exp() * torch.log_softmax(draft, -1)).sum(-1)
    assert torch.allclose(ce, dense, atol=1e-5)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-5)
    # a top-3 target keeps its rest as one mass: KL >= 0, 0 when the draft has the same coarse shape
    v3, i3 = vals[:, :3], ids[:, :3]
    ce3, ent3 = sparse_cross_entropy(target, i3, v3)
    assert torch.allclose(ce3, ent3, atol=1e-5)
    assert ((ce3 - ent3) >= -1e-6).all() and ((sparse_cross_entropy(draft, i3, v3)[0] - ent3) > 0).all()


def test_online_loss_trains_the_predictor() -> None:
    model = tiny_model("llama")
    pred = new_predictor(model, LAYERS, None, seed=1)
    seq = _sequence(length=40, prompt=5, chains=[(6, 0, 3), (10, 2, 3)])
    opt = torch.optim.Adam(pred.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss, parts = online_loss(pred, pred, seq, OnlineLossConfig(state_noise=0.0), torch.device("cpu"))
        first = first if first is not None else parts["kl0"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert parts["kl0"] < 0.8 * first


def _chat_prompts(tok, words=("red", "blue", "cyan", "green")) -> list[list[int]]:
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"say {w} please"}], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for w in words]


def test_onpolicy_stage_records_trains_bounds_its_buffer_and_resumes(tiny_run, tmp_path) -> None:
    from sot.train.onpolicy import OnPolicyConfig, ReplayBuffer, train_onpolicy

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": c["id"], "prompt": c["conversations"][0]["value"]}) + "\n"
                               for c in conversations(6)))
    out = tmp_path / "op"
    cfg = OnPolicyConfig(model=str(tiny_run["model_dir"]), init_from=str(tiny_run["predictor"]), out=str(out),
                         iterations=2, prompts_per_iteration=3, prompts_file=str(prompts), batch_size=3,
                         max_new_tokens=24, steps_per_iteration=2, tokens_per_step=64, buffer_gb=1e-9)
    path = train_onpolicy(cfg)
    report = json.loads((out / "report.json").read_text())
    assert path.is_file() and (out / "predictor-it1.safetensors").is_file()
    assert report["iterations_done"] == 2 and report["steps"] == 4
    assert report["decode_seconds"] > 0 and report["train_seconds"] > 0
    assert all(p["mean_accepted"] > 0 for p in report["phases"]), "the trained predictor accepts some tokens"
    buf = ReplayBuffer(out / "buffer", 10**12)
    assert len(buf.shards()) == 1, "the buffer keeps its newest shard when over its bound"
    seq = buf.items[0]
    assert seq.chains.shape[0] > 0 and seq.top_ids.shape[1] == 32
    # resuming adds an iteration, not a fresh start
    cfg.iterations = 3
    train_onpolicy(cfg)
    report = json.loads((out / "report.json").read_text())
    assert report["iterations_done"] == 3 and report["steps"] == 6 and len(report["phases"]) == 3
    # ... and ends where an unbroken run with the same seed ends, weight for weight
    whole = train_onpolicy(dataclasses.replace(cfg, out=str(tmp_path / "whole")))
    assert whole.read_bytes() == (out / "predictor.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="holds a run made with seed 0 .now 1."):
        train_onpolicy(dataclasses.replace(cfg, seed=1))
    for bad, match in ((dict(code_share=1.5), "code-share"), (dict(max_seconds=-5.0), "max-seconds"),
                       (dict(temperatures=(float("nan"),)), "temperatures"),
                       (dict(temperatures=(0.0, -1.0)), r"must each be >= 0, got \[0.0, -1.0\]")):
        with pytest.raises(ConfigError, match=match):
            train_onpolicy(OnPolicyConfig(out=str(tmp_path / "x"), **bad))
    # a folder holding a model, or another stage's run, is refused and left as it was
    import shutil

    for folder, kind in ((tiny_run["model_dir"], "a model folder"), (Path(tiny_run["cfg"].out), "a fit run")):
        copy = tmp_path / f"copy-{folder.name}"
        shutil.copytree(folder, copy)
        before = (copy / "config.json").read_bytes()
        with pytest.raises(ConfigError, match="that no onpolicy run wrote"):
            train_onpolicy(dataclasses.replace(cfg, out=str(copy)))
        assert (copy / "config.json").read_bytes() == before, kind


def test_onpolicy_stopped_while_decoding_resumes_to_the_unbroken_runs_weights(tiny_run, tmp_path,
                                                                             monkeypatch) -> None:
    """A decode phase stopped midway is decoded again on resuming, from the random states it
    began with: the run ends with the weights of one never stopped."""
    from sot.train import onpolicy
    from sot.train.onpolicy import OnPolicyConfig, train_onpolicy

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": c["id"], "prompt": c["conversations"][0]["value"]}) + "\n"
                               for c in conversations(6)))
    cfg = OnPolicyConfig(model=str(tiny_run["model_dir"]), init_from=str(tiny_run["predictor"]),
                         out=str(tmp_path / "whole"), iterations=2, prompts_per_iteration=3, prompts_file=str(prompts),
                         batch_size=1, max_new_tokens=16, steps_per_iteration=2, tokens_per_step=64,
                         temperatures=(0.0, 1.0))
    whole = train_onpolicy(cfg)
    decode, calls = onpolicy._decode, []

    def stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the second prompt of the second iteration
            raise KeyboardInterrupt
        return decode(*args, **kwargs)

    monkeypatch.setattr(onpolicy, "_decode", stopped)
    broken = dataclasses.replace(cfg, out=str(tmp_path / "broken"))
    with pytest.raises(KeyboardInterrupt):
        train_onpolicy(broken)
    monkeypatch.setattr(onpolicy, "_decode", decode)
    assert train_onpolicy(broken).read_bytes() == whole.read_bytes()


def test_onpolicy_skips_a_prompt_too_long_for_the_context(tiny_run, tmp_path, capsys) -> None:
    """One over-long prompt is skipped with a line saying so; the run goes on with the rest."""
    from sot.train.onpolicy import OnPolicyConfig, train_onpolicy

    prompts = tmp_path / "prompts.jsonl"
    long = " ".join(["word"] * 600)  # (past the tiny model's 512 positions)
    short = conversations(2)[0]["conversations"][0]["value"]
    prompts.write_text(json.dumps({"id": "long", "prompt": long}) + "\n" + json.dumps({"id": "s", "prompt": short})
                       + "\n")
    out = tmp_path / "op"
    cfg = OnPolicyConfig(model=str(tiny_run["model_dir"]), init_from=str(tiny_run["predictor"]), out=str(out),
                         iterations=1, prompts_per_iteration=2, prompts_file=str(prompts), batch_size=2,
                         max_new_tokens=16, steps_per_iteration=1, tokens_per_step=64)
    assert train_onpolicy(cfg).is_file()
    assert "skipped 1 prompt(s) too long for the model's context of 512 tokens" in capsys.readouterr().out
    assert json.loads((out / "report.json").read_text())["iterations_done"] == 1


def _adapt_engine(tiny_run, config: AdaptConfig, train_step=None, policy=STATIC):
    from sot.models.loading import load_model

    loaded = load_model(str(tiny_run["model_dir"]))
    target = TargetModel(loaded.model, state_layers=LAYERS)
    drafter = make_drafter("state", loaded.model, tiny_run["predictor"], top_k=3, lookup=False)
    engine = Engine(target, drafter, TreeBudget(13, 4), policy=policy)
    return loaded, target, engine, Adapter(engine, config, train_step=train_step)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_adaptation_is_lossless_and_updates_the_drafter(tiny_run, temperature: float) -> None:
    cfg = AdaptConfig(budget=1.0, lr=3e-3, window=4, rows=64, max_drift=10.0, tolerance=0.99, first_guess=0.0)
    loaded, target, engine, adapter = _adapt_engine(tiny_run, cfg, policy=None)
    prompts = _chat_prompts(loaded.tokenizer) * 2
    params = GenerationParams(max_new_tokens=40, sampling=SamplingParams(temperature=temperature, seed=5,
                                                                         mode=SamplingMode.COUPLED))
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    before = adapter.live_weights()
    for batch in (1, 3):
        got = [r.token_ids for r in engine.generate(prompts, params, batch_size=batch)]
        assert got == plain
    assert adapter.updates > 0, adapter.stats()
    after = adapter.live_weights()
    assert any(not torch.equal(before[n], after[n]) for n in before), ("the drafter's weights moved", adapter.stats())


def test_a_corrupted_update_is_rolled_back(tiny_run) -> None:
    def corrupt(seq) -> None:  # an update that wrecks the predictor
        with torch.no_grad():
            for p in adapter.model.parameters():
                p.add_(torch.randn_like(p) * 0.05 * p.abs().mean().clamp(min=1e-3) * 40)

    cfg = AdaptConfig(budget=1.0, window=12, tolerance=0.3, max_drift=1e9, first_guess=0.0)
    loaded, target, engine, adapter = _adapt_engine(tiny_run, cfg, train_step=lambda seq: corrupt(seq))
    prompts = _chat_prompts(loaded.tokenizer) * 3
    params = GenerationParams(max_new_tokens=60)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    loaded_weights = adapter.live_weights()
    got = [r.token_ids for r in engine.generate(prompts, params, batch_size=1)]
    assert got == plain
    assert adapter.rollbacks >= 1
    if adapter._pending is None and adapter.rollbacks == adapter.updates:  # every update came back
        now = adapter.live_weights()
        assert all(torch.equal(loaded_weights[n], now[n]) for n in now)


def test_the_trust_region_resets_to_the_loaded_weights(tiny_run) -> None:
    def jump(seq) -> None:
        with torch.no_grad():
            for p in adapter.model.parameters():
                p.mul_(1.5)

    cfg = AdaptConfig(budget=1.0, max_drift=0.1, window=10**6, first_guess=0.0)
    loaded, target, engine, adapter = _adapt_engine(tiny_run, cfg, train_step=jump)
    start = adapter.live_weights()
    engine.generate(_chat_prompts(loaded.tokenizer)[:2], GenerationParams(max_new_tokens=20), batch_size=1)
    assert adapter.resets >= 1 and adapter.resets == adapter.updates
    now = adapter.live_weights()
    assert all(torch.equal(start[n], now[n]) for n in now)


def test_the_update_budget_is_respected(tiny_run) -> None:
    # An update starts only when the time spent so far plus the longest update yet (or the first guess,
    # before any) fits the budget share of the engine's step time. Checked at each admission from the
    # adapter's own clocks, so the test does not depend on how noisy the machine's timings are.
    admissions: list[tuple[float, float, float]] = []

    def counted(seq) -> None:
        estimate = adapter.longest_update if adapter.updates else adapter.config.first_guess
        admissions.append((adapter.update_seconds, estimate, adapter.step_seconds()))
        adapter.learner.step(seq)

    runs = {}
    for budget in (0.05, 1.0):
        cfg = AdaptConfig(budget=budget, window=10**6, first_guess=0.0)
        loaded, target, engine, adapter = _adapt_engine(tiny_run, cfg, train_step=counted)
        engine.generate(_chat_prompts(loaded.tokenizer) * 3, GenerationParams(max_new_tokens=60), batch_size=1)
        assert len(admissions) == adapter.updates >= 1
        for spent, estimate, steps in admissions:
            assert spent + estimate <= budget * steps + 1e-9
        # so the whole overshoots the budget by at most one update's excess over the longest before it
        assert adapter.update_seconds <= budget * adapter.step_seconds() + adapter.longest_update + 1e-9
        runs[budget] = adapter.updates
        admissions.clear()
    assert runs[1.0] > runs[0.05] >= 1


def test_adapt_needs_a_state_predictor_and_a_sane_budget(tiny_run) -> None:
    model = tiny_model("llama")
    engine = Engine(TargetModel(model), NoDrafter())
    with pytest.raises(ConfigError, match="state predictor"):
        Adapter(engine)
    with pytest.raises(ConfigError, match="budget"):
        AdaptConfig(budget=0.0).check()
    nan = float("nan")  # (a NaN passes every comparison's negation: lr <= 0 is False for it)
    for bad, message in (({"lr": nan}, "lr must be a finite number"), ({"max_drift": nan}, "max_drift"),
                         ({"first_guess": nan}, "first_guess"), ({"queue": 0}, "queue must be >= 1"),
                         ({"anchor": -1.0}, "anchor must be >= 0"), ({"budget": "0.5"}, "budget"),
                         ({"tolerance": 1.0}, "tolerance must be below 1")):
        with pytest.raises(ConfigError, match=message):
            AdaptConfig(**bad).check()


def test_server_metrics_report_adaptation() -> None:
    from sot.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.adaptation({"updates": 3, "rollbacks": 1, "resets": 0, "update_seconds": 0.5, "step_seconds": 10.0,
                  "drift": 0.01})
    m.adaptation({"updates": 5, "rollbacks": 1, "resets": 0, "update_seconds": 0.75, "step_seconds": 15.0,
                  "drift": 0.02})
    text = m.render().decode()
    assert "sot:adapt_updates_total 5.0" in text and "sot:adapt_rollbacks_total 1.0" in text
    assert "sot:adapt_time_share 0.05" in text and "sot:adapt_drift 0.02" in text


def test_cli_refuses_adapt_without_a_predictor(tiny_run) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sot.cli", "generate", "say red", "--model", str(tiny_run["model_dir"]),
                          "--drafter", "pld", "--adapt", "--max-new-tokens", "4"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "adapts a state predictor" in out.stderr and "Traceback" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "sot.cli", "generate", "x", "--adapt-budget", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--adapt-budget" in bad.stderr


def test_onpolicy_checks_its_prompts_first_and_stops_when_none_fits(tiny_run, tmp_path) -> None:
    """An empty prompt file stops the run before anything is written to --out (a corrected
    command then starts clean); prompts all too long for the context stop it with a clear
    error instead of training steps on nothing."""
    from sot.train.onpolicy import OnPolicyConfig, train_onpolicy

    empty, long = tmp_path / "empty.jsonl", tmp_path / "long.jsonl"
    empty.write_text("")
    long.write_text(json.dumps({"id": "long", "prompt": " ".join(["word"] * 600)}) + "\n")
    base = dict(model=str(tiny_run["model_dir"]), init_from=str(tiny_run["predictor"]), iterations=1,
                prompts_per_iteration=1, batch_size=1, max_new_tokens=16, steps_per_iteration=1, tokens_per_step=64)
    with pytest.raises(ConfigError, match="holds no prompts"):
        train_onpolicy(OnPolicyConfig(out=str(tmp_path / "a"), prompts_file=str(empty), **base))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="no recorded sequence to train on"):
        train_onpolicy(OnPolicyConfig(out=str(tmp_path / "b"), prompts_file=str(long), **base))
