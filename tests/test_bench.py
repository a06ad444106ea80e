"""``sot bench`` end to end on a tiny model: outputs, schema and internal consistency."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import tiny_model_dir
from sot.acceptance import Acceptance
from sot.bench.runner import BenchConfig, run_bench
from sot.cli import main
from sot.errors import ConfigError, SoTError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = tiny_model_dir(root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["abcabcabc", "hello hello", "xyz xyz xy"]))
    return model, prompts, root


def _config(model: Path, prompts: Path, out: Path, **kw) -> BenchConfig:
    base = dict(prompts=str(prompts), methods=("hf", "plain", "pld"), model=str(model), max_new_tokens=24,
                chat=False, ignore_eos=True, warmup_tokens=4, out=str(out), notes=[])
    base.update(kw)
    return BenchConfig(**base)


def test_bench_outputs_and_consistency(setup) -> None:
    model, prompts, root = setup
    out = root / "run"
    rc = main(["bench", "--prompts", str(prompts), "--methods", "hf,plain,pld", "--model", str(model),
               "--max-new-tokens", "24", "--no-chat", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    for name in ("results.json", "report.md", "hf.jsonl", "plain.jsonl", "pld.jsonl", "speedup.png", "accept_hist.png", "accept_depth.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "sot-bench/1"
    records = res["records"]
    assert len(records) == 3 * 3
    for name, agg in res["methods"].items():
        mine = [r for r in records if r["method"] == name]
        assert agg["new_tokens"] == sum(r["new_tokens"] for r in mine) == 3 * 24
        assert agg["seconds"] == pytest.approx(sum(r["wall_time"] for r in mine))
        assert agg["tokens_per_s"] == pytest.approx(agg["new_tokens"] / agg["seconds"])
        assert agg["peak_rss_mb"] > 0 and agg["run_rss_growth_mb"] >= 0
        for r in mine:
            if r["accept_lengths"]:
                assert sum(r["accept_lengths"]) + 1 == r["new_tokens"]  # +1: the token from prefill
    # Per-prompt speedups are ratios of times (equal token counts here).
    by = {(r["method"], r["prompt_index"]): r for r in records}
    ratios = sorted(by[("hf", i)]["wall_time"] / by[("pld", i)]["wall_time"] for i in range(3))
    s = res["methods"]["pld"]["speedup_vs_hf"]
    assert s["median"] == pytest.approx(ratios[1]) and s["min"] == pytest.approx(ratios[0]) and s["max"] == pytest.approx(ratios[2])
    assert res["methods"]["pld"]["identical_to_plain"] == "3/3"
    spec = [json.loads(line) for line in (out / "pld.jsonl").read_text().splitlines()]
    assert {"new_tokens", "wall_time", "accept_lengths"} <= set(spec[0]["choices"][0])
    assert "| pld |" in (out / "report.md").read_text()
    machine = res["machine"]
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1 and isinstance(machine["native_bf16"], bool)
    assert f"SIMD {machine['simd']}" in (out / "report.md").read_text()


def _first_child(tree, logits, argmax=None) -> Acceptance:
    """A broken acceptance rule: always the first child, wrong wherever the drafts are."""
    kids = tree.children()
    path, tokens, node = [0], [], 0
    while kids[node]:
        node = kids[node][0]
        path.append(node)
        tokens.append(tree.tokens[node])
    # (the engine passes the argmax of the rows a greedy walk reaches, -1 elsewhere)
    if argmax is None:
        tokens.append(int(logits[node].argmax()))
    else:
        tokens.append(argmax[node] if argmax[node] >= 0 else tree.tokens[node])
    return Acceptance(path, tokens)


def test_bench_catches_a_lossy_method(setup, monkeypatch) -> None:
    """A deliberately broken acceptance rule (always take the first child) must show up in
    the identity column."""
    import sot.verify as verify

    monkeypatch.setattr(verify, "accept_greedy", _first_child)
    model, prompts, root = setup
    res = run_bench(_config(model, prompts, root / "lossy", methods=("plain", "pld")))
    agg = res["methods"]["pld"]
    assert agg["identical_to_plain"] != "3/3"
    assert agg["divergences"] and "first_divergent_token" in agg["divergences"][0]
    first = agg["divergences"][0]
    line = (f"- pld differs from plain decoding on {len(agg['divergences'])} prompt(s): prompt "
            f"{first['prompt_index']} at token {first['first_divergent_token']}")
    assert line in (root / "lossy" / "report.md").read_text()


def test_a_report_without_matplotlib_or_plain_still_says_what_it_can(setup, monkeypatch) -> None:
    """Without matplotlib the report is written (with a note instead of plots); a policy sweep
    without plain shows no ratio to plain rather than 0.00x; a dtype-swept predictor file is
    held to its own mode's plain decoding."""
    import builtins

    from sot.bench.methods import RunRecord
    from sot.bench.report import NO_PLOTS, aggregate

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    model, prompts, root = setup
    res = run_bench(_config(model, prompts, root / "bare", methods=("pld",), max_new_tokens=8, limit=1,
                            sweep=("policy", ("heuristic", "static"))))
    assert all(r["tokens_per_s_vs_plain"] is None for r in res["sweep"]["rows"])
    report = (root / "bare" / "report.md").read_text()
    assert NO_PLOTS in report and "0.00x" not in report and "| heuristic | " in report
    monkeypatch.setattr(builtins, "__import__", real)
    names = ["plain[float32]", "state[p1][float32]"]
    runs = [RunRecord(method=m, prompt_index=0, prompt_id="0", prompt_tokens=3, token_ids=[1, 2], new_tokens=2,
                      wall_time=1.0 if m.startswith("plain") else 0.5, ttft=0.1) for m in names]
    held = aggregate(runs, names, model_rss=0, exact=set(names))["state[p1][float32]"]
    assert held["identical_to_plain"] == "1/1" and held["speedup_vs_plain"]["median"] == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["max-depth", "warmup"])
def test_sweep(setup, name) -> None:
    model, prompts, root = setup
    cfg = _config(model, prompts, root / f"sweep-{name}", methods=("plain", "pld"), max_new_tokens=16, sweep=(name, (1, 4)))
    res = run_bench(cfg)
    rows = res["sweep"]["rows"]
    assert [r["value"] for r in rows] == [1, 4]
    assert all(r["identical_to_plain"] == "3/3" for r in rows)
    assert all(r["tokens_per_s_vs_plain"] > 0 for r in rows)
    assert (root / f"sweep-{name}" / "sweep.png").is_file()


@pytest.mark.parametrize("sizes", [(1, 3), (2,)], ids=["with-batch-1", "without-batch-1"])
def test_batch_size_sweep_checks_every_sequence_against_alone(setup, sizes) -> None:
    """Each size of ``--sweep batch-size`` counts, for plain and the method, the sequences equal
    to their prompt decoded alone: batch 1's plain answers where 1 is swept, else plain
    decoding of each prompt alone."""
    model, prompts, root = setup
    out = root / f"sweep-batch-{'-'.join(map(str, sizes))}"
    res = run_bench(_config(model, prompts, out, methods=("plain", "pld"), max_new_tokens=16,
                            sweep=("batch-size", sizes)))
    rows = res["sweep"]["rows"]
    assert [r["value"] for r in rows] == list(sizes)
    for r in rows:
        assert (r["identical_to_plain"], r["plain_identical_to_alone"], r["identical_to_alone"]) == ("3/3",) * 3
    assert "| identical to alone (plain / method) |" in (out / "report.md").read_text()


def test_batched_bench_checks_each_sequence_against_alone(setup) -> None:
    model, prompts, root = setup
    out = root / "batch"
    rc = main(["bench", "--prompts", str(prompts), "--methods", "plain,pld", "--model", str(model), "--batch-size", "2",
               "--max-new-tokens", "16", "--no-chat", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    for name in ("plain", "pld"):
        agg = res["methods"][name]
        assert agg["identical_to_alone"] == "3/3" and agg["new_tokens"] == 3 * 16
    assert "decoded alone: 3/3" in (out / "report.md").read_text()
    speedup = res["methods"]["pld"]["speedup_vs_plain"]  # (the batch's: its prompts share one time)
    assert speedup["min"] is None and speedup["median"] > 0
    # seeded sampling: each prompt alone draws the noise of its index in the batch
    assert main(["bench", "--prompts", str(prompts), "--methods", "plain,pld", "--model", str(model), "--batch-size",
                 "2", "--max-new-tokens", "8", "--no-chat", "--temperature", "1", "--seed", "3", "--out",
                 str(root / "batch-sampled")]) == 0
    sampled = json.loads((root / "batch-sampled" / "results.json").read_text())["methods"]
    assert sampled["plain"]["identical_to_alone"] == sampled["pld"]["identical_to_alone"] == "3/3"
    assert main(["bench", "--prompts", str(prompts), "--methods", "hf,plain", "--model", str(model),
                 "--batch-size", "2", "--out", str(out)]) == 2


def test_bench_compares_predictor_files_side_by_side(setup) -> None:
    from sot.drafters.state import new_predictor, save_predictor
    from sot.models.loading import load_model

    model, prompts, root = setup
    target = load_model(str(model)).model
    (root / "pa").mkdir(exist_ok=True)
    a, b = root / "pa" / "predictor.safetensors", root / "pb.safetensors"
    save_predictor(new_predictor(target, (0, 1, 2), None, seed=1), a)
    save_predictor(new_predictor(target, (0, 1, 2), None, seed=2), b)
    out = root / "predictors"
    rc = main(["bench", "--prompts", str(prompts), "--methods", f"plain,state={a},state={b}", "--model", str(model),
               "--max-new-tokens", "16", "--no-chat", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"plain", "state[pa]", "state[pb]"}
    for name in ("state[pa]", "state[pb]"):
        assert res["methods"][name]["identical_to_plain"] == "3/3"
        assert res["methods"][name]["speedup_vs_plain"] is not None
    # two files that would show under one name, and a missing file, are refused
    assert main(["bench", "--prompts", str(prompts), "--methods", f"plain,state={a},state={a}", "--model", str(model),
                 "--out", str(out)]) == 2
    assert main(["bench", "--prompts", str(prompts), "--methods", f"plain,state={root / 'none.safetensors'}",
                 "--model", str(model), "--out", str(out)]) == 2


def test_multiturn_conversations_report_each_turn(setup, tmp_path) -> None:
    """``--multiturn`` answers every turn and appends it before the next; suffix and auto stay
    identical to plain on every turn, and the report gives each turn apart."""
    model, _, _ = setup
    convs = tmp_path / "convs.jsonl"
    convs.write_text("\n".join(json.dumps({"id": f"c{i}", "turns": [f"say {w} {w}", "again, please", "once more"]})
                               for i, w in enumerate(["abc", "xyz"])))
    out = tmp_path / "run"
    rc = main(["bench", "--prompts", str(convs), "--multiturn", "--methods", "plain,suffix,auto", "--model", str(model),
               "--max-new-tokens", "24", "--chat", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert sorted(res["turns"]) == ["1", "2", "3"]
    assert len(res["records"]) == 2 * 3 * 3
    assert {r["turn"] for r in res["records"]} == {1, 2, 3}
    for name in ("suffix", "auto"):
        assert res["methods"][name]["identical_to_plain"] == "6/6"
        for turn in res["turns"].values():
            assert turn[name]["vs_plain"] == pytest.approx(turn[name]["tokens_per_s"] / turn["plain"]["tokens_per_s"])
    assert "## by turn" in (out / "report.md").read_text()
    # a later turn's prompt holds the earlier answers: it is longer than the first turn's
    plain = sorted((r for r in res["records"] if r["method"] == "plain"), key=lambda r: r["prompt_index"])
    assert plain[2]["prompt_tokens"] > plain[1]["prompt_tokens"] > plain[0]["prompt_tokens"] + 24
    # ... and it reuses the earlier turn's rows, its prompt and (as far as it re-tokenizes the same) its answer
    assert plain[1]["cached_tokens"] >= plain[0]["prompt_tokens"] and plain[2]["cached_tokens"] >= plain[1]["prompt_tokens"]
    assert res["turns"]["3"]["plain"]["cached_share"] > 0.5 and "prompt reused" in (out / "report.md").read_text()


def test_builtin_multiturn_sets() -> None:
    from sot.bench.conversations import load_conversations, render

    agent = load_conversations("agent-loop")
    assert len(agent) == 8 and all(len(r["turns"]) == 4 and r["system"] for r in agent)
    assert len({r["turns"][0] for r in agent}) == 8  # the values vary by conversation
    edits = load_conversations("code-edit-multiturn")
    assert edits and all(len(r["turns"]) == 3 and "```" in r["turns"][0] for r in edits)
    # without a chat template the turns alternate as User: / Assistant: lines
    text = render(agent[0], ["first answer"], chat=False)["prompt"]
    assert text.startswith("System: ") and "\nAssistant: first answer\nUser: " + agent[0]["turns"][1] in text
    assert text.endswith("Assistant:")
    assert render(agent[0], [], chat=True)["messages"][-1] == {"role": "user", "content": agent[0]["turns"][0]}
    share = load_conversations("sharegpt-multiturn", limit=4)
    assert len(share) == 4 and all(len(r["turns"]) == 3 for r in share)


def test_policy_sweep_runs_each_policy_as_a_method(setup) -> None:
    from sot.bench.runner import parse_sweep

    assert parse_sweep("policy=heuristic,learned,rl") == ("policy", ("heuristic", "learned", "rl"))
    with pytest.raises(ConfigError, match="distinct policies"):
        parse_sweep("policy=heuristic,fast")
    model, prompts, root = setup
    cfg = _config(model, prompts, root / "sweep-policy", methods=("plain", "pld"), max_new_tokens=16,
                  sweep=("policy", ("heuristic", "static")))
    res = run_bench(cfg)
    assert set(res["methods"]) == {"plain", "pld[heuristic]", "pld[static]"}
    rows = res["sweep"]["rows"]
    assert [r["value"] for r in rows] == ["heuristic", "static"]
    assert all(r["identical_to_plain"] == "3/3" and r["tokens_per_s_vs_plain"] > 0 for r in rows)
    assert "sequence steps with the predictor idle" in (root / "sweep-policy" / "report.md").read_text()


def test_code_edit_set_asks_to_refactor_humaneval_solutions() -> None:
    from sot.bench.prompts import load_prompt_set
    from sot.data.humaneval import problems

    items = load_prompt_set("code-edit", limit=3)
    ref = problems()[:3]
    assert [it["id"] for it in items] == [p["task_id"].replace("HumanEval", "CodeEdit") for p in ref]
    for it, p in zip(items, ref):
        assert "Refactor" in it["turns"][0] and p["canonical_solution"] in it["turns"][0]


def test_long_context_set_reviews_modules_of_three_sizes_in_turn() -> None:
    from sot.bench.prompts import load_prompt_set
    from sot.data.humaneval import LONG_CONTEXT_CHARS, problems

    items = load_prompt_set("long-context", limit=4)
    assert [it["id"] for it in items] == [f"long-context-{i}" for i in range(4)]
    sizes = [len(it["turns"][0]) for it in items]
    assert all(size >= LONG_CONTEXT_CHARS[i % 3] for i, size in enumerate(sizes)) and sizes[0] < sizes[1] < sizes[2]
    pool = problems()
    assert pool[0]["canonical_solution"] in items[0]["turns"][0]  # consecutive solutions, none repeated
    assert not any(pool[0]["prompt"] in it["turns"][0] for it in items[1:])


def test_lockstep_batches_take_turns_by_step_and_time_each_method_on_its_own_steps() -> None:
    """Batched methods advance a step at a time in rotating order, each step reading at most
    the prompt budget's tokens (so that no step is long); each method's records add up to its
    own steps' time, and its outputs equal its engine decoding alone, prompts read whole."""
    import time

    from helpers import random_prompts, tiny_model
    from sot.bench.methods import EngineMethod, run_lockstep
    from sot.drafters import DrafterKind, TreeBudget, make_drafter
    from sot.engine import GenerationParams
    from sot.models.adapter import TargetModel

    target = TargetModel(tiny_model("llama", seed=3), state_layers=())
    methods = [EngineMethod("plain", target, make_drafter(DrafterKind.NONE), TreeBudget(8, 4)),
               EngineMethod("pld", target, make_drafter(DrafterKind.PLD), TreeBudget(8, 4))]
    prompts = random_prompts((9, 14, 6, 11, 7), seed=2)
    params = GenerationParams(max_new_tokens=20)
    order: list[str] = []
    spent = {"plain": 0.0, "pld": 0.0}
    budgets: set[int | None] = set()
    for m in methods:
        step = m.engine.step

        def timed(step=step, name=m.name, engine=m.engine):
            order.append(name)
            budgets.add(engine.prompt_budget)
            t0 = time.perf_counter()
            out = step()
            spent[name] += time.perf_counter() - t0
            return out

        m.engine.step = timed
    finished = {"plain": 0, "pld": 0}
    runs = run_lockstep(methods, prompts, params, 2, lambda name, n: finished.__setitem__(name, finished[name] + n),
                        prompt_budget=5)
    assert finished == {"plain": 5, "pld": 5}
    assert budgets == {5} and all(m.engine.prompt_budget is None for m in methods), "set for the run, then restored"
    both = min(order.count("plain"), order.count("pld"))
    pairs = [tuple(order[2 * i: 2 * i + 2]) for i in range(both)]
    assert pairs[0] == ("plain", "pld") and pairs[1] == ("pld", "plain"), "the first to step rotates"
    assert all(set(p) == {"plain", "pld"} for p in pairs), "neither engine takes two steps in a row while both run"
    for m in methods:
        recs = runs[m.name]
        assert [r.method for r in recs] == [m.name] * 5
        # the wrapper times inside the method's clock, so that clock is a little more
        assert spent[m.name] * (1 - 1e-9) <= sum(r.wall_time for r in recs) <= 1.1 * spent[m.name]
        del m.engine.step  # the engine's own step again
        alone = m.engine.generate(prompts, params, batch_size=2)
        assert [r.token_ids for r in recs] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in runs["plain"]] == [20] * 5


def test_dtype_sweep_runs_each_mode_against_its_own_plain(setup) -> None:
    """``--sweep dtype=float32,int8``: every engine method in each mode, in the same alternating
    rounds; each speculative method is held to its own mode's plain decoding (identical in
    both), and the rows compare the modes."""
    from sot.bench.runner import parse_sweep
    from sot.kernels import cpu_kernels

    assert parse_sweep("dtype=float32,int8") == ("dtype", ("float32", "int8"))
    for bad in ("dtype=float32,float32", "dtype=auto,int8", "dtype=int4"):
        with pytest.raises(ConfigError, match="distinct modes"):
            parse_sweep(bad)
    if cpu_kernels() is None:
        pytest.skip("the int8 mode needs the compiled CPU kernels")
    model, prompts, root = setup
    out = root / "sweep-dtype"
    cfg = _config(model, prompts, out, methods=("plain", "pld"), max_new_tokens=16,
                  sweep=("dtype", ("float32", "int8")))
    res = run_bench(cfg)
    assert set(res["methods"]) == {"plain[float32]", "pld[float32]", "plain[int8]", "pld[int8]"}
    assert all(res["methods"][f"pld[{mode}]"]["identical_to_plain"] == "3/3" for mode in ("float32", "int8"))
    assert res["methods"]["plain[int8]"]["speedup_vs_plain"] is None
    rows = res["sweep"]["rows"]
    assert [r["value"] for r in rows] == ["float32", "int8"] and rows[0]["plain_vs_first"] == 1.0
    assert all(r["tokens_per_s_vs_plain"] > 0 for r in rows)
    assert "| mode | plain tok/s |" in (out / "report.md").read_text()
    from sot.bench.runner import build_methods

    policies, _, _ = build_methods(_config(model, prompts, out, methods=("plain", "pld"),
                                           sweep=("policy", ("heuristic", "static"))))
    pld = [m for m in policies if m.name.startswith("pld[")]
    assert len(pld) == 2 and pld[0].engine.drafter is not pld[1].engine.drafter, "each policy has its own drafter"
    built, _, _ = build_methods(cfg)
    assert {m.name: m.engine.target.int8 for m in built} == {"plain[float32]": False, "plain[int8]": True,
                                                             "pld[float32]": False, "pld[int8]": True}
    with pytest.raises(ConfigError, match="batch size 1"):
        run_bench(_config(model, prompts, root / "no", methods=("plain", "pld"), batch_size=2,
                          sweep=("dtype", ("float32", "int8"))))


def test_auto_runs_each_method_in_its_own_mode_and_holds_it_to_plain_in_that_mode(setup, monkeypatch) -> None:
    """``--dtype auto`` picks each method's mode for its own drafter (here: plain decoding in
    float32, ``pld`` in bfloat16, as on an AMX machine); ``pld`` is held to plain decoding in
    bfloat16, alone and in a batch, so a lossy acceptance still shows."""
    import sot.bench.runner as runner
    import sot.verify as verify
    from sot.dtype_choice import DtypeChoice

    asked = []

    def choose(name, model, drafter="auto", predictor=None, device="cpu", batch=1):
        asked.append((drafter, batch))
        return DtypeChoice("float32" if drafter == "none" else "bfloat16", "measured", drafter)

    monkeypatch.setattr(runner, "resolve_choice", choose)
    model, prompts, root = setup
    built, _, target = runner.build_methods(_config(model, prompts, root / "modes", methods=("plain", "pld")))
    assert {m.name: m.engine.target.model.dtype for m in built} == {"plain": torch.float32, "pld": torch.bfloat16}
    assert target is built[0].engine.target and asked == [("none", 1), ("pld", 1)]
    # without memory for a second copy, every method runs in the drafting method's mode (loaded first)
    with monkeypatch.context() as patch:
        patch.setattr(runner, "room_beside", lambda target, ratio: ratio < 2)  # (float32 beside bfloat16: no room)
        cfg = _config(model, prompts, root / "modes", methods=("plain", "pld"))
        built, _, target = runner.build_methods(cfg)
    assert {m.name: m.engine.target.model.dtype for m in built} == {"plain": torch.bfloat16, "pld": torch.bfloat16}
    assert built[0].engine.target is built[1].engine.target is target
    assert cfg.method_dtypes == {"plain": "bfloat16", "pld": "bfloat16"}
    assert any("too little memory to load float32 beside bfloat16" in n for n in cfg.notes)
    alone = runner._alone_outputs
    decoded = []  # the modes plain decoding ran in, untimed, to hold the methods to

    def spy(target, *args):
        decoded.append(target.model.dtype)
        return alone(target, *args)

    monkeypatch.setattr(runner, "_alone_outputs", spy)
    for batch in (1, 2):
        out = root / f"modes-{batch}"
        decoded.clear()
        res = run_bench(_config(model, prompts, out, methods=("plain", "pld"), max_new_tokens=16, batch_size=batch))
        # (batch 1: plain's own outputs check plain's mode; a batch checks every mode against alone)
        assert decoded == ([torch.bfloat16] if batch == 1 else [torch.float32, torch.bfloat16])
        assert res["config"]["method_dtypes"] == {"plain": "float32", "pld": "bfloat16"}
        assert res["methods"]["pld"]["identical_to_plain"] == "3/3"
        if batch > 1:
            assert res["methods"]["plain"]["identical_to_alone"] == res["methods"]["pld"]["identical_to_alone"] == "3/3"
        report = (out / "report.md").read_text()
        assert "engine auto (plain float32, pld bfloat16)" in report and "decoded once more untimed" in report
    assert asked[-2:] == [("none", 2), ("pld", 2)]
    # the reference in pld's mode is what pld is held to: a token changed in it shows
    monkeypatch.setattr(runner, "_alone_outputs", lambda *args: [ids[:-1] + [ids[-1] + 1] if j == 0 else ids
                                                                 for j, ids in enumerate(alone(*args))])
    res = run_bench(_config(model, prompts, root / "modes-ref", methods=("plain", "pld"), max_new_tokens=16))
    assert res["methods"]["pld"]["identical_to_plain"] == "2/3"
    monkeypatch.setattr(verify, "accept_greedy", _first_child)
    res = run_bench(_config(model, prompts, root / "modes-lossy", methods=("plain", "pld"), max_new_tokens=16))
    assert res["methods"]["pld"]["identical_to_plain"] != "3/3"


def test_bench_inputs_are_checked_before_models_load_and_results_survive(setup, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """Bad prompts files, methods and sweeps stop the bench before a model loads (the model path
    here does not exist, so a load would fail with another message); a prompt too long for the
    context is named before anything runs; an output folder never overwrites the prompts or
    keeps an earlier run's files; Ctrl-C keeps the prompts every method finished."""
    model, prompts, root = setup
    bad = tmp_path / "bad.jsonl"
    for text, message in (('{"turns": ["ok", 5]}', "needs 'prompt'"),
                          ('{"turns": ["ok"], "system": 5}', "'system' must be a string"),
                          ('{"prompt": "caf\\udc80"}', ":1: the text is not valid UTF-8")):
        bad.write_text(text + "\n")
        for extra in ([], ["--multiturn"]):
            assert main(["bench", "--prompts", str(bad), "--model", "/no/such/model", *extra,
                         "--out", str(tmp_path / "o")]) == 2
            err = capsys.readouterr().err
            assert message in err and "no/such/model" not in err, (text, err)
    for extra, message in ((["--methods", ""], "names no method"),
                           (["--methods", "plain,pld", "--sweep", "max-depth=0"], "integers >= 1"),
                           (["--methods", "plain,suffix", "--sweep", "max-depth=2"], "pld or state")):
        assert main(["bench", "--prompts", str(prompts), "--model", "/no/such/model", *extra]) == 2
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "o").exists()  # nothing was made for a bench that could not run
    with pytest.raises(ConfigError, match="would overwrite the prompts file"):
        run_bench(_config(model, tmp_path / "plain.jsonl", tmp_path, methods=("plain",)))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"id": "big", "prompt": "x" * 600}) + "\n")
    with pytest.raises(SoTError, match=r"prompt 2 \(id big\): the prompt has"):
        run_bench(_config(model, long, tmp_path / "long", methods=("plain", "pld")))

    out = tmp_path / "again"
    run_bench(_config(model, prompts, out, methods=("plain", "pld"), max_new_tokens=8))
    assert (out / "pld.jsonl").is_file()
    from sot.bench import runner

    calls = []
    real = runner._run_one

    def interrupted(method, ids, params, index, pid):
        if len(calls) == 3:  # prompt 1 by both methods, then prompt 2 by plain
            raise KeyboardInterrupt
        calls.append(method.name)
        return real(method, ids, params, index, pid)

    monkeypatch.setattr(runner, "_run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_bench(_config(model, prompts, out, methods=("plain", "suffix"), max_new_tokens=8))
    res = json.loads((out / "results.json").read_text())
    assert res["partial"] is True and "interrupted" in res["notes"][0]
    assert sorted((r["method"], r["prompt_index"]) for r in res["records"]) == [("plain", 0), ("suffix", 0)]
    assert not (out / "pld.jsonl").exists() and (out / "suffix.jsonl").is_file()  # the earlier run's are gone
    monkeypatch.setattr(runner, "_run_one", real)
    # stopped in a batch, the sequences every method finished are kept; stopped before any
    # result is written (the warm-up, here), the earlier results stay as they were
    from sot.engine import Engine

    step, steps = Engine.step, []

    def stopping(engine, *args, **kwargs):
        steps.append(1)
        if len(steps) == limit:
            raise KeyboardInterrupt
        return step(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "step", stopping)
    alone, marks = runner._alone_outputs, []
    monkeypatch.setattr(runner, "_alone_outputs", lambda *a: marks.append(len(steps)) or alone(*a))
    batch = dict(methods=("plain", "pld"), max_new_tokens=8, batch_size=2)
    limit = 0  # (never: a whole run, to count its steps)
    whole = run_bench(_config(model, prompts, out, **batch))
    decoded = marks[0]  # steps until every method's batch was done (then each prompt is decoded alone)
    for limit in (2, decoded, decoded + 2):
        steps.clear()
        with pytest.raises(KeyboardInterrupt):
            run_bench(_config(model, prompts, out, **batch))
        part = json.loads((out / "results.json").read_text())
        kept = {m: sorted(r["prompt_index"] for r in part["records"] if r["method"] == m) for m in batch["methods"]}
        if limit == 2:  # (in the warm-up)
            assert part["records"] == json.loads(json.dumps(whole["records"]))
        elif limit == decoded:  # (the batches' last step: the last answer is not in)
            assert part["partial"] is True and kept["plain"] == kept["pld"] and 0 < len(kept["plain"]) < 3, kept
        else:  # (the answers are all in; they were not compared with each prompt alone)
            assert part["partial"] is True and kept["plain"] == kept["pld"] == [0, 1, 2], kept
            assert "not compared" in part["notes"][-1] and "identical_to_alone" not in part["methods"]["pld"]


def test_arms_table_reports_decoding_alone_against_the_first_arm() -> None:
    """The side-by-side scripts' table: decoding's rate leaves out the first token's time, the
    ratio and the answers are against the first arm."""
    from types import SimpleNamespace

    from sot.bench.report import arms_table

    def done(ids: list[int], seconds: float, first: float) -> SimpleNamespace:
        return SimpleNamespace(token_ids=ids, seconds=seconds, first_token_seconds=first, mean_accept_len=1.5)

    got = {"a": [done([1, 2, 3], 3.0, 1.0), done([4, 5], 2.0, 1.0)],  # 3 tokens after the first in 3 s
           "b": [done([1, 2, 3], 1.5, 0.5), done([4, 6], 1.5, 1.0)]}  # 3 in 1.5 s
    lines = arms_table(got, "arm").splitlines()
    assert lines[0].startswith("| arm | decode tok/s | vs a |")
    assert lines[2] == "| a | 1.0 | 1.000x | 1.000 | 1.50 | 2/2 |"
    assert lines[3] == "| b | 2.0 | 2.000x | 0.750 | 1.50 | 1/2 |"
