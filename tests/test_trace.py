"""Step traces: the records reproduce the output and the statistics, the predicted states are
the predictor's, and the page works in a real browser without the network."""
from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from helpers import random_prompts, tiny_model
from sot.drafters import PromptLookupDrafter, TreeBudget
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel, transformers_attention
from sot.policy import PolicyConfig, PolicyKind
from sot.trace import TracedSequence, compare_states, read_trace, write_trace

LAYERS = (1, 2)
PARAMS = GenerationParams(max_new_tokens=40)


STATIC = PolicyConfig(kind=PolicyKind.STATIC)  # drafts every step: predicted states at every depth


def _state_run(seed: int = 1, policy: PolicyConfig | None = STATIC):
    model = tiny_model("llama", seed=4)
    target = TargetModel(model, state_layers=LAYERS)
    predictor = new_predictor(model, LAYERS, None, seed=seed)
    prompts = random_prompts((20, 33), seed=2)
    engine = Engine(target, StateDrafter(predictor, top_k=3), TreeBudget(16, 6), record_steps=True, policy=policy)
    return model, predictor, prompts, engine.generate(prompts, PARAMS)


def _replay(records) -> list[int]:
    out: list[int] = []
    for rec in records:
        path = [rec.tokens[i] for i in rec.accepted[1:]]
        out.extend((path + ([rec.bonus] if rec.bonus is not None else []))[: rec.committed])
    return out


@pytest.mark.parametrize("drafter", ["state", "pld"])
def test_accepted_paths_and_bonus_tokens_reproduce_the_output(drafter: str) -> None:
    if drafter == "state":
        _, _, _, results = _state_run()
    else:
        target = TargetModel(tiny_model("qwen2", seed=2))
        engine = Engine(target, PromptLookupDrafter(), TreeBudget(16, 6), record_steps=True)
        results = engine.generate(random_prompts((25, 40), seed=3), PARAMS)
    for r in results:
        assert r.step_records and _replay(r.step_records) == r.token_ids
        assert any(len(rec.accepted) > 1 for rec in r.step_records), "some drafts must be accepted"
        assert any(not all(rec.verified) or len(rec.accepted) < sum(rec.verified) for rec in r.step_records)


def test_plain_decoding_steps_are_plain_steps() -> None:
    """Without a drafter every step after the prompt's is a plain step, in the trace and in
    the result's count (the policy still plans them, for a drafter that proposes nothing)."""
    from sot.drafters import make_drafter

    engine = Engine(TargetModel(tiny_model("llama", seed=2)), make_drafter("none"), record_steps=True)
    for r in engine.generate(random_prompts((9, 14), seed=1), PARAMS):
        assert [rec.mode for rec in r.step_records] == ["prefill"] + ["plain"] * r.steps
        assert r.plain_steps == r.steps > 0


def test_per_depth_counts_equal_the_result_statistics() -> None:
    _, _, _, results = _state_run(policy=None)  # the adaptive policy: free drafts and plain steps too
    for r in results:
        assert r.step_records[0].mode == "prefill" and r.step_records[0].committed == 1
        recs = r.step_records[1:]
        assert [rec.step for rec in recs] == list(range(1, len(recs) + 1))
        assert [rec.committed for rec in recs] == r.accept_lengths
        assert [sum(rec.verified) for rec in recs] == r.tree_sizes
        attempts, accepts = [0] * len(r.depth_attempts), [0] * len(r.depth_accepts)
        for rec in recs:
            depth = [0] * len(rec.tokens)
            for i in range(1, len(rec.tokens)):
                depth[i] = depth[rec.parents[i]] + 1
            reach = len(rec.accepted) - 1
            for d in range(1, max([depth[i] for i in range(len(depth)) if rec.verified[i]]) + 1):
                if reach >= d - 1:
                    attempts[d - 1] += 1
                    accepts[d - 1] += reach >= d
        assert attempts == r.depth_attempts and accepts == r.depth_accepts
        assert sum(rec.mode in ("plain", "fallback") for rec in recs) + sum(rec.mode == "free" for rec in recs) \
            == r.plain_steps


def test_predicted_states_are_the_predictors_own() -> None:
    """Rerun offline: the training unroll over the final text (the target's states of every
    position, step ``j`` at row ``L - 1 + j``) gives the state recorded for the depth-``j``
    node of the accepted path of a step rooted at ``L``."""
    model, predictor, prompts, results = _state_run()
    checked = [0, 0]
    for prompt, r in zip(prompts, results):
        ids = prompt + r.token_ids
        with transformers_attention(model), torch.no_grad():
            hidden = model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            states = torch.stack([hidden[i][0] for i in LAYERS], dim=1)  # [T, S, D], float32
        depth = max(len(rec.accepted) for rec in r.step_records)
        with torch.no_grad():
            outs = predictor.forward_unrolled(states[None], torch.tensor([ids[1:] + [0]]), depth)
            normed = [predictor.out_norm(o[0]) for o in outs]
        for rec in r.step_records:
            for j, vec in enumerate(rec.predicted or []):
                if vec is None:
                    continue
                want = normed[j][rec.position - 1 + j]
                assert torch.allclose(torch.tensor(vec), want, atol=1e-4, rtol=1e-4), (rec.step, j)
                checked[min(j, 1)] += 1
    assert checked[0] > 20 and checked[1] > 10, checked  # roots, and deeper nodes


def test_trace_file_round_trip_and_state_comparison(tmp_path: Path) -> None:
    model, _, prompts, results = _state_run()
    traced = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        states = compare_states(model, p, r.token_ids, r.step_records)
        assert len(states["actual"]) == len(r.token_ids)
        assert all(-1.0 <= c["cosine"] <= 1.0 and c["rel_error"] >= 0 for c in states["compare"])
        assert {c["depth"] for c in states["compare"]} >= {0, 1}
        traced.append(TracedSequence(i, p, r.token_ids, [str(t) for t in r.token_ids], "", r.finish_reason, 1.0, 1.0,
                                     [rec.to_json() for rec in r.step_records], states))
    write_trace(tmp_path / "t.jsonl", {"model": "tiny"}, traced)
    run, back = read_trace(tmp_path / "t.jsonl")
    assert run["model"] == "tiny" and back == traced
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    for text, message in (('{"type": "step"}', ":1: not a SoT trace line"),  # no sequence before it
                          ('"str"', ":1: not a SoT trace line \\(a JSON str, not an object\\)"),
                          ("[1, 2]", ":1: not a SoT trace line \\(a JSON list"),
                          ("null", ":1: not a SoT trace line"),
                          ('{"index": 0}', ":1: not a SoT trace line \\('type'\\)"),
                          (lines[1], "sequence 0 has no step lines"),
                          ("\n".join(lines[:2] + [lines[2].replace('"mode"', '"mood"')]), ":3: not a SoT trace line")):
        bad.write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            read_trace(bad)
    step = lines[2]
    for text, message in ((step.replace('"mode": "', '"mode": "<a href=x>'), "malformed mode"),
                          (step.replace('"tokens": [', '"tokens": ["x", '), "malformed tokens"),
                          ("\n".join(lines[:3] + lines[1:3]), "sequence index 0 is not a new integer")):
        bad.write_text("\n".join(lines[:2] + [text]) + "\n" if text.startswith('{"type": "step"') else text + "\n")
        with pytest.raises(ValueError, match=message):
            read_trace(bad)
    bad.write_bytes(b'{"type": "run", "model": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: not UTF-8 text"):
        read_trace(bad)
    (tmp_path / "later.jsonl").write_text("\n".join(lines + ['{"type": "a later kind of line"}']) + "\n")
    assert read_trace(tmp_path / "later.jsonl")[1] == traced  # skipped
    # a write stopped midway (Ctrl-C) leaves the earlier trace whole, and no stray file
    before = (tmp_path / "t.jsonl").read_bytes()
    stopping = [TracedSequence(9, [1], [2], ["x"], "", "length", 1.0, 1.0, [{"mode": object()}])]
    with pytest.raises(TypeError):
        write_trace(tmp_path / "t.jsonl", {"model": "tiny"}, traced + stopping)
    assert (tmp_path / "t.jsonl").read_bytes() == before and sorted(os.listdir(tmp_path)) == [
        "bad.jsonl", "later.jsonl", "t.jsonl"]
    # a path that is not a regular file (a pipe, /dev/stdout) is written as it is, not replaced
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    write_trace(pipe, {"model": "tiny"}, traced)
    reader.join(timeout=30)
    assert got and got[0].count(b"\n") == len(lines) and pipe.is_fifo()


def test_recording_is_off_by_default() -> None:
    model = tiny_model("llama", seed=4)
    target = TargetModel(model, state_layers=LAYERS)
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    res = Engine(target, drafter, TreeBudget(16, 6)).generate(random_prompts((20,), seed=2), PARAMS)[0]
    assert res.step_records == [] and drafter.predicted_states(res.request_id) is None


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="no system Chromium (Debian: apt-get install chromium); CI installs it and runs this test")
def test_the_page_in_a_real_browser(tmp_path: Path) -> None:
    """Headless Chromium: no console errors, no network request, one element per token, the
    tree changes with the selected step, and the screenshot is not blank. The answer opens an
    HTML comment and a script tag and the tokens' text holds chart markup (``<b>``): the page
    draws all the same, and shows that text as written."""
    from playwright.sync_api import sync_playwright

    from sot.trace_page import write_page

    assert CHROMIUM is not None, "CI must install Debian's chromium"
    model, _, prompts, results = _state_run()
    seqs = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        seqs.append(TracedSequence(i, p, r.token_ids, [f"t{t} " for t in r.token_ids], "", r.finish_reason, 1.0, 1.0,
                                   [rec.to_json() for rec in r.step_records],
                                   compare_states(model, p, r.token_ids, r.step_records),
                                   vocab={str(t): f"<b>t{t}</b>" for t in range(96)}))
    seqs[0].pieces[:3] = ["<!-- ", "<script>", ""]  # the third: part of a character the next completes
    plain = Engine(TargetModel(model), PromptLookupDrafter(), TreeBudget(1, 1), record_steps=True)  # (no drafts)
    r = plain.generate(prompts[:1], GenerationParams(max_new_tokens=6))[0]
    seqs.append(TracedSequence(2, prompts[0], r.token_ids, [f"t{t} " for t in r.token_ids], "", r.finish_reason,
                               float("nan"), 1.0, [rec.to_json() for rec in r.step_records]))
    page_file = tmp_path / "trace.html"
    write_page(page_file, {"model": "tiny", "drafter": "state", "dtype": "float32"}, seqs)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda req: requests.append(req.url))
            page.goto(page_file.as_uri())
            page.wait_for_selector("#tree .main-svg")
            assert page.locator("#tokens .tok").count() == len(results[0].token_ids)
            assert page.locator("#tokens .tok.part").count() == 1
            assert page.locator("#tokens .tok").first.text_content() == "<!-- "
            title = lambda: page.locator("#tree .gtitle").text_content()  # noqa: E731
            nodes = lambda: page.locator("#tree .textpoint").all_text_contents()  # noqa: E731
            first, first_nodes = title(), nodes()  # the first verify step is shown at first
            assert first.startswith("step 1:") and len(first_nodes) == len(results[0].step_records[1].tokens)
            assert all(n.startswith('"<b>t') for n in first_nodes), first_nodes
            later = next(rec.step for rec in results[0].step_records[2:]
                         if rec.tokens != results[0].step_records[1].tokens)
            page.locator(f'#tokens .tok[data-step="{later}"]').first.click()
            assert title().startswith(f"step {later}:") and nodes() != first_nodes
            page.locator("#step").fill("1")
            assert title() == first and nodes() == first_nodes
            # an answer nothing was drafted for (tau NaN: JSON has none) shows notes, not empty charts, and back
            page.select_option("#sequence", "2")
            assert "no step verified a drafted token" in page.locator("#acceptance").text_content()
            assert "mean accepted length 0.00" in page.locator("#summary").text_content()  # (null, not NaN)
            page.select_option("#sequence", "0")
            assert page.locator("#acceptance .main-svg").count() >= 1 and page.locator("#acceptance p").count() == 0
            shot = page.screenshot(full_page=True)
            assert errors == [], errors
            assert [u for u in requests if not u.startswith("file:")] == []
        finally:
            browser.close()
    import io

    from PIL import Image  # (Pillow comes with matplotlib, a test extra)

    pixels = Image.open(io.BytesIO(shot)).convert("L")
    lo, hi = pixels.getextrema()
    assert hi - lo > 100, "the screenshot is blank"


def test_fallback_and_probe_steps_are_labelled(monkeypatch) -> None:
    """A policy that never finds drafting fast enough falls back: its plain steps (the last one
    before each probe included) are recorded as fallback, and each probe as a drafting step
    marked probe. (The batch planner is told to keep every sequence drafting, so that the
    per-sequence fallback, not the planner, is what stops it.)"""
    from sot.policy import CommitPolicy

    monkeypatch.setattr(CommitPolicy, "worth_drafting", lambda self, drafting, rows: drafting)
    model = tiny_model("llama", seed=4)
    target = TargetModel(model, state_layers=LAYERS)
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3, lookup=False)
    engine = Engine(target, drafter, TreeBudget(16, 6), record_steps=True,
                    policy=PolicyConfig(fallback_threshold=1000.0))
    res = engine.generate(random_prompts((20,), seed=2), GenerationParams(max_new_tokens=60))[0]
    recs = res.step_records[1:]
    modes = [rec.mode for rec in recs]
    assert res.fallbacks >= 2 and set(modes) == {"draft", "fallback"}, modes
    assert sum(m == "fallback" for m in modes) == res.plain_steps
    probes = [i for i, rec in enumerate(recs) if rec.probe]
    assert res.fallbacks - 1 <= len(probes) <= res.fallbacks  # the last countdown may outlast the answer
    assert all(modes[i] == "draft" and modes[i - 1] == "fallback" for i in probes)


def test_state_comparison_runs_on_every_family() -> None:
    """The target's own forward over the answer works for a family without SDPA attention
    (Gemma 2's soft cap), and the model still decodes through SoT afterwards."""
    model = tiny_model("gemma2", seed=1)
    target = TargetModel(model, state_layers=(1, 2))
    drafter = StateDrafter(new_predictor(model, (1, 2), None, seed=1), top_k=3)
    prompt = random_prompts((20,), seed=3)
    res = Engine(target, drafter, TreeBudget(16, 6), record_steps=True, policy=STATIC).generate(prompt, PARAMS)[0]
    states = compare_states(model, prompt[0], res.token_ids, res.step_records)
    assert len(states["actual"]) == len(res.token_ids) and states["compare"]
    again = Engine(target, drafter, TreeBudget(16, 6), policy=STATIC).generate(prompt, PARAMS)[0]
    assert again.token_ids == res.token_ids


def test_tokens_holding_part_of_a_character_are_told_apart() -> None:
    """A byte-level token that holds part of a character decodes to U+FFFD; its label shows
    its bytes instead, so the tree's different tokens never read alike."""
    from transformers import AutoTokenizer

    from sot.detokenize import token_label
    from sot.models.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    ids = tokenizer.encode("🎉 日本語 ünïcödé")
    labels = [token_label(tokenizer, t) for t in ids]
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert len(partial) >= 4 and all("\ufffd" not in label for label in labels)
    assert len({token_label(tokenizer, t) for t in partial}) == len(set(partial))
    assert token_label(tokenizer, ids[0]) == "\\xf0\\x9f"  # the emoji's first two bytes
    whole = tokenizer.encode(" hello")
    assert [token_label(tokenizer, t) for t in whole] == [tokenizer.decode([t]) for t in whole]


def test_an_output_over_an_input_or_another_output_is_refused(tmp_path: Path) -> None:
    """``--out``, ``--save`` and ``--trace`` never write over a file the command reads or
    another it writes: refused before the model loads, the files untouched."""
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    root = Path(__file__).resolve().parent.parent
    for args, message in ((["trace", "--prompts", str(prompts), "--save", str(prompts)], "--save .* --prompts"),
                          (["trace", "hi", "--out", str(tmp_path / "x"), "--save", str(tmp_path / "x")],
                           "--out .* --save"),
                          (["generate", "--prompts", str(prompts), "--trace", str(tmp_path / "." / "p.jsonl")],
                           "--trace .* --prompts")):
        proc = subprocess.run([sys.executable, "-m", "sot.cli", *args], capture_output=True, text=True, cwd=root,
                              timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert re.search(message, proc.stderr), proc.stderr
    assert prompts.read_text() == '{"prompt": "hi"}\n' and not (tmp_path / "x").exists()
    # flags that take a file or the text itself: a long text is no file name, and no error
    import argparse

    from sot.cli.common import check_distinct_files

    schema = '{"type": "object", "description": "' + "x" * 600 + '"}'
    check_distinct_files(argparse.Namespace(json_schema=schema, tools="[" + " " * 400 + "]",
                                            trace=str(tmp_path / "t.jsonl")))
