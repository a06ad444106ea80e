"""The CLI and the Python API on a tiny model folder, and the errors a user can hit."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model_dir
from sot import SoT
from sot.cli import build_parser, main
from sot.errors import ConfigError, ModelLoadError, PromptTooLongError, UnsupportedModelError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", max_positions=160)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sot.cli", *args], capture_output=True, text=True, timeout=300)


def test_kv_cache_dtype_reaches_the_engine_from_generate_and_bench(model_dir: Path, tmp_path: Path) -> None:
    """--kv-cache-dtype float16 gives the engine of sot generate (and serve, which loads the
    same way) and of sot bench a float16 cache where SoT's CPU attention runs."""
    import torch

    from sot.bench.runner import BenchConfig, build_methods
    from sot.cli.common import load_sot
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    args = build_parser().parse_args(["generate", "x", "--model", str(model_dir), "--dtype", "float32",
                                      "--drafter", "pld", "--kv-cache-dtype", "float16"])
    sot = load_sot(args)
    assert sot.target.kv_dtype == torch.float16 and sot.target.new_cache(1, 64).keys.dtype == torch.float16
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    cfg = BenchConfig(prompts=str(prompts), methods=("plain",), model=str(model_dir), dtype="float32",
                      kv_cache_dtype="float16", out=str(tmp_path / "out"), notes=[])
    _, _, target = build_methods(cfg)
    assert target.kv_dtype == torch.float16


def test_generate_json_fields(model_dir: Path, capsys) -> None:
    rc = main(["generate", "hello there", "--model", str(model_dir), "--max-new-tokens", "12", "--json", "--ignore-eos"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("text", "token_ids", "new_tokens", "seconds", "tokens_per_s", "mean_accept_len", "steps"):
        assert key in record
    assert record["new_tokens"] == len(record["token_ids"]) == 12
    assert record["mean_accept_len"] >= 1.0


def test_generate_json_logprobs(model_dir: Path, capsys) -> None:
    rc = main(["generate", "hello there", "--model", str(model_dir), "--max-new-tokens", "6", "--json", "--ignore-eos",
               "--logprobs", "2"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    entries = record["logprobs"]
    assert [e["token"] for e in entries] == record["token_ids"] and all(len(e["top"]) == 2 for e in entries)
    assert all(e["logprob"] <= 0 and isinstance(e["text"], str) for e in entries)
    # the alternatives' texts beside their ids (greedy: the first alternative is the token itself)
    argmax = [e for e in entries if e["top"][0][0] == e["token"]]
    assert argmax and all(len(e["top_text"]) == 2 and e["top_text"][0] == e["text"] for e in argmax)
    assert main(["generate", "hello there", "--model", str(model_dir), "--logprobs", "2"]) == 2
    assert "--logprobs needs --json" in capsys.readouterr().err


def test_score_gives_the_models_log_probabilities(model_dir: Path, tmp_path: Path, capsys) -> None:
    """``SoT.score`` and ``sot score``: each token's log probability after the ones before it
    is the model's log-softmax there; batching changes nothing; the perplexity follows."""
    import math

    import torch

    from transformers import AutoModelForCausalLM

    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = ["abcabcabd hello", "xyz"]
    scores = sot.score(texts, top_logprobs=2, batch_size=2)
    for text, sc in zip(texts, scores):
        ids = sot.encode(text, chat=False)
        assert sc.token_ids == ids and sc.logprobs[0] is None and sc.scored_tokens == len(ids) - 1
        with torch.no_grad():
            want = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
        got = torch.tensor([e.logprob for e in sc.logprobs[1:]])
        assert torch.allclose(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)
        assert all(len(e.top) == 2 and e.top[0][1] >= e.logprob - 1e-6 for e in sc.logprobs[1:])
        assert math.isclose(sc.perplexity, math.exp(-sum(got.tolist()) / len(got)), rel_tol=1e-6)
    assert [s.logprobs for s in sot.score(texts)] != [s.logprobs for s in scores]  # (no alternatives asked)
    alone = [sot.score([t], top_logprobs=2)[0].logprobs for t in texts]
    assert alone == [s.logprobs for s in scores]
    assert main(["score", texts[0], "--model", str(model_dir), "--json", "--top-logprobs", "1",
                 "--dtype", "float32"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["token_ids"] == scores[0].token_ids and record["logprobs"][0] is None
    assert [e["logprob"] for e in record["logprobs"][1:]] == [e.logprob for e in scores[0].logprobs[1:]]
    assert all(len(e["top_text"]) == 1 and isinstance(e["top_text"][0], str) for e in record["logprobs"][1:])
    assert main(["score", "--model", str(model_dir)]) == 2
    assert "give either a TEXT or --prompts" in capsys.readouterr().err
    assert main(["score", texts[0], "--model", str(model_dir), "--top-logprobs", "1"]) == 2
    assert "--top-logprobs needs --json" in capsys.readouterr().err


def test_score_refuses_what_it_cannot_read(model_dir: Path) -> None:
    """A text past the context, bytes that are not UTF-8 and arguments of the wrong type are
    errors that say so."""
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    assert len(sot.score("a" * 159)[0].token_ids) == 159
    with pytest.raises(ConfigError, match="text 0 has 160 tokens; this model scores at most 159"):
        sot.score("a" * 160)
    with pytest.raises(ConfigError, match=r"not valid UTF-8 \(the byte 0xff at character 3\)"):
        sot.score("hi \udcff there")
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        sot.generate({"messages": [{"role": "user", "content": "\udcfe"}]}, chat=True, max_new_tokens=2)
    with pytest.raises(ConfigError, match="top_logprobs must be an integer"):
        sot.score("a b", top_logprobs="3")
    with pytest.raises(ConfigError, match="list of prompts, got int"):
        sot.score(5)


def test_one_prompt_or_stop_string_may_be_a_plain_string(model_dir: Path) -> None:
    """A string is one prompt (or one stop string), not a list of characters; a stream's
    text ends before the stop string, as the whole answer's does; a conversation is scored
    as it is, with no answer opened after it."""
    sot = SoT.load(str(model_dir), drafter="pld", dtype="float32")
    kw = dict(max_new_tokens=20, chat=False, ignore_eos=True)
    one = sot.generate("abcabc", **kw)
    assert len(one) == 1 and one[0].token_ids == sot.generate(["abcabc"], **kw)[0].token_ids
    stop = one[0].text[4:6]
    cut = sot.generate("abcabc", stop=stop, **kw)[0]
    assert cut.finish_reason == "stop" and cut.token_ids == sot.generate(["abcabc"], stop=[stop], **kw)[0].token_ids
    events = list(sot.stream("abcabc", stop=stop, **kw))
    assert "".join(e.text for e in events) == cut.text and stop not in cut.text and events[-1].finished
    assert len(sot.score("abcabc")) == 1
    talk = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    scored = sot.score(talk, chat=True)[0]
    assert scored.token_ids == sot.encode(talk, chat=True, generation_prompt=False)
    assert sot.tokenizer.decode(scored.token_ids).endswith("assistant: hello<unk>")  # ("\\n" is <unk>)


def test_wrong_types_are_clear_errors_and_leave_the_engine_usable(model_dir: Path) -> None:
    from sot.drafters import NoDrafter
    from sot.engine import Engine
    from sot.requests import GenerationParams

    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    for bad, message in ((dict(max_new_tokens="5"), "max_new_tokens must be an integer"),
                         (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
                         (dict(top_k=2.5), "top_k must be an integer"),
                         (dict(temperature=None), "temperature must be a finite number")):
        with pytest.raises(ConfigError, match=message):
            sot.generate("abc", chat=False, **bad)
    for prompt in ("hello", [1, "2"], [10**6]):
        with pytest.raises(ConfigError, match="the prompt"):
            sot.engine.add_request(prompt, GenerationParams(max_new_tokens=2))
    assert not sot.engine.has_unfinished()
    import numpy as np

    rid = sot.engine.add_request([np.int64(t) for t in sot.encode("abc", chat=False)],  # (any integer type)
                                 GenerationParams(max_new_tokens=2))
    assert sot.engine.abort(rid) and not sot.engine.has_unfinished()
    # a request keeps its own settings: a list of stop strings changed afterwards changes nothing
    stops = ["zzz"]
    sot.engine.add_request(sot.encode("abc", chat=False), GenerationParams(max_new_tokens=4, stop=stops))
    stops.append(5)
    while sot.engine.has_unfinished():
        sot.engine.step()
    for bad, message in ((dict(priority="high"), "priority must be an integer"),
                         (dict(tenant=5), "tenant must be a string"), (dict(index=1.5), "index must be an integer")):
        with pytest.raises(ConfigError, match=message):
            sot.engine.add_request([3, 4], GenerationParams(max_new_tokens=2), **bad)
    bare = Engine(sot.target, NoDrafter())  # (no decode: no text to find a stop string in)
    with pytest.raises(ConfigError, match="stop strings need the text"):
        bare.add_request([3, 4], GenerationParams(max_new_tokens=2, stop=("x",)))
    with pytest.raises(ConfigError, match="chat must be True, False or None"):
        sot.generate("abc", chat="yes")
    with pytest.raises(ConfigError, match="token ids go to SoT.generate_ids"):
        sot.generate([[3, 4]])
    # a key that only looks like a number ("²" counts as a digit to str.isdigit), a flag that is not one
    with pytest.raises(ConfigError, match="logit_bias token"):
        sot.params(logit_bias={"²": 1.0})
    assert sot.params(logit_bias={" 7 ": 1.0, "-0": 2.0}).sampling.logit_bias == ((0, 2.0), (7, 1.0))
    for flag in ("ignore_eos", "skip_special_tokens"):
        with pytest.raises(ConfigError, match=f"{flag} must be True or False"):
            sot.params(**{flag: "no"})
    for bad, message in ((dict(prefix_cache_mb=0.5), "prefix_cache_mb must be an integer"),
                         (dict(max_nodes=0), "max_nodes must be >= 1"),
                         (dict(max_nodes=10**11), "max_nodes must be >= 1 and <= 256"),  # (not a 24 GB tree)
                         (dict(predictor_nodes=0), "predictor_nodes must be >= 1"),
                         (dict(predictor_depth=-1), "predictor_depth must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            SoT.load(str(model_dir), **bad)
    assert len(sot.generate("abc", chat=False, max_new_tokens=2)[0].token_ids) <= 2
    # stop strings are found in the text the answer returns: with special tokens kept, "</s>" is there
    kw = dict(chat=False, max_new_tokens=5, ignore_eos=True, logit_bias={2: 100})
    assert sot.generate("abc", skip_special_tokens=False, **kw)[0].text == "</s>" * 5
    kept = sot.generate("abc", skip_special_tokens=False, stop=["</s>"], **kw)[0]
    assert (kept.finish_reason, kept.token_ids, kept.text) == ("stop", [2], "")
    assert "".join(e.text for e in sot.stream("abc", skip_special_tokens=False, stop=["</s>"], **kw)) == ""
    skipped = sot.generate("abc", stop=["</s>"], **kw)[0]
    assert (skipped.finish_reason, len(skipped.token_ids), skipped.text) == ("length", 5, "")
    sampled = dict(chat=False, max_new_tokens=4, temperature=1.0, seed=3)
    assert sot.generate("abc", top_k=-1, **sampled)[0].token_ids == sot.generate("abc", top_k=0, **sampled)[0].token_ids
    assert SoT.load(str(model_dir), drafter="pld", dtype="float32", policy="static").engine.policy_config.kind.value \
        == "static"
    with pytest.raises(ConfigError, match="unknown policy 'fast'"):
        SoT.load(str(model_dir), drafter="pld", dtype="float32", policy="fast")
    with pytest.raises(ConfigError, match="suffix_store needs a drafter"):  # (before the missing model is read)
        SoT.load("/no/such/model", drafter="none", suffix_store="s.store")
    with pytest.raises(ConfigError, match="predictor is read by the auto and state drafters only, not by pld"):
        SoT.load("/no/such/model", drafter="pld", predictor="p.safetensors")


def test_files_the_cli_cannot_read_or_write_are_clean_errors(model_dir: Path, tmp_path: Path, capsys,
                                                            monkeypatch) -> None:
    """Caught before any model loads where it can be; exit 2 with one line naming the file."""
    base = ["generate", "abc", "--model", "/no/such/model"]  # (a load would fail with another message)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"type": "object", "description": "caf\xe9"}')
    (tmp_path / "broken.json").write_text('{"type": "object",')
    for extra, message in ((["--trace", str(tmp_path / "no" / "t.jsonl")], "does not exist"),
                           # (a folder that takes no new file, whatever its permission bits say to root)
                           (["--trace", "/proc/sot-trace.jsonl"], "cannot write in /proc"),
                           (["--json-schema", str(latin)], "not UTF-8 text"),
                           (["--tools", str(latin)], "not UTF-8 text"),
                           (["--grammar", str(latin)], "not UTF-8 text"),
                           (["--prediction", str(latin)], "not UTF-8 text"),
                           (["--prediction", str(tmp_path / "none.py")], "No such file"),
                           (["--json-schema", str(tmp_path / "broken.json")], "not JSON"),
                           (["--regex", "([a-z"], "the regex is not valid: at 1(8): invalid regex \"([a-z\" (in "
                                                  "regex): regex parse error: unclosed character class\n"),
                           (["--drafter", "pld", "--predictor", str(model_dir / "config.json")],
                            "--predictor is read by --drafter auto and state only, not by pld"),
                           (["--trace", str(tmp_path)], "is a folder"),
                           (["--suffix-store", str(tmp_path / "no" / "s.store")], "does not exist"),
                           (["--suffix-store", "/dev/null"], "not a regular file"),
                           (["--drafter", "pld", "--suffix-store", str(tmp_path / "s.store")],
                            "--suffix-store needs a drafter that drafts from earlier answers"),
                           (["--tools", str(tmp_path / "tools.json")], "no such file"),
                           (["--json-schema", str(tmp_path / "schema.json")], "no such file"),
                           (["--chat-template", str(tmp_path)], "is a folder"),
                           (["--policy", "learned", "--policy-model", str(tmp_path)], "is a folder"),
                           # (a policy that reads no model file is not given one silently)
                           (["--policy", "heuristic", "--policy-model", str(model_dir / "config.json")],
                            "the heuristic policy reads no model file"),
                           (["--dtype", "bfloat16", "--kv-cache-dtype", "float16"],
                            "--kv-cache-dtype float16 takes a float32 engine")):
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "model path" not in err and "Traceback" not in err, (extra, err)
    from sot.files import replace_file

    with pytest.raises(OSError) as failed:  # (a write that fails anyway names the file asked for)
        replace_file("/proc/sot-store.bin", lambda part: part.write_text("x"))
    assert failed.value.filename == "/proc/sot-store.bin" and ".part" not in str(failed.value), str(failed.value)
    with pytest.raises(IsADirectoryError, match="a folder, not a file"):  # (no temporary file beside the folder)
        replace_file(tmp_path, lambda part: part.write_text("x"))
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*"))
    assert main(["trace", "abc", "--model", "/no/such/model", "--out", str(tmp_path / "no" / "x.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    saved = tmp_path / "saved.jsonl"
    assert main(["trace", "--from", str(saved), "--save", str(tmp_path / "copy.jsonl")]) == 2
    assert "with --from the data is already in" in capsys.readouterr().err
    assert main(["trace", "--from", str(saved), "--max-new-tokens", "5", "--temperature", "0.5"]) == 2
    assert "--max-new-tokens, --temperature would change nothing" in capsys.readouterr().err  # (not ignored)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert main(["generate", "--prompts", str(latin), "--model", "/no/such/model"]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    # training that would write over the predictor it starts from, or regenerate answers over its prompts
    run = tmp_path / "run"
    run.mkdir()
    (run / "predictor.safetensors").write_bytes(b"kept")
    for cmd in (["fit", "--data", str(tmp_path / "data")], ["onpolicy"]):
        assert main(["train", *cmd, "--init-from", str(run / "predictor.safetensors"), "--out", str(run)]) == 2
        assert "would replace the predictor it starts from" in capsys.readouterr().err
    assert (run / "predictor.safetensors").read_bytes() == b"kept"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "1", "prompt": "hi"}\n')
    assert main(["train", "gen-data", "--model", "/no/such/model", "--prompts", str(prompts),
                 "--out", str(prompts)]) == 2
    assert "is also --prompts's file" in capsys.readouterr().err
    for layers in ("1,1,1", "2,1,0"):
        assert main(["train", "prepare", "--model", str(model_dir), "--out", str(tmp_path / "prep"), "--layers",
                     layers]) == 2
        assert "--layers must be distinct and ascending" in capsys.readouterr().err
    assert main(["score", "a", "--model", str(model_dir), "--json"]) == 0  # one token: no perplexity
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"] is None
    assert main(["score", "a", "--model", str(model_dir)]) == 0
    assert "perplexity - (one token: nothing scored)" in capsys.readouterr().out
    import sot.cli as cli

    def unwritable(args):  # a file error after the model loaded: one line naming the file, exit 2
        raise PermissionError(13, "Permission denied", "/srv/out.jsonl")

    monkeypatch.setitem(cli.HANDLERS, "generate", unwritable)
    assert main(["generate", "hi"]) == 2
    assert capsys.readouterr().err == "sot: error: /srv/out.jsonl: Permission denied\n"

    def disk_full(args):  # an error with no file name (writing to /dev/full): one line too
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(cli.HANDLERS, "generate", disk_full)
    assert main(["generate", "hi"]) == 2
    assert capsys.readouterr().err == "sot: error: No space left on device\n"
    assert main(["trace", "abc", "--out", ""]) == 2
    assert capsys.readouterr().err == "sot: error: --out needs a file path\n"
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("sot ")


def test_generate_structured_output_flags(model_dir: Path, tmp_path: Path, capsys) -> None:
    import re

    base = ["generate", "abc", "--model", str(model_dir), "--max-new-tokens", "30", "--json", "--no-chat",
            "--temperature", "1", "--seed", "2"]
    assert main([*base, "--regex", r"[a-d]{3}\d{2}"]) == 0
    assert re.fullmatch(r"[a-d]{3}\d{2}", json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "<" ("x" | "y")+ ">"')
    assert main([*base, "--grammar", str(grammar)]) == 0
    assert re.fullmatch(r"<[xy]+>", json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    assert main([*base, "--regex", "[a-"]) == 2
    assert "the regex is not valid" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # one form at a time
        main([*base, "--regex", "a", "--choice", "b"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_generate_tool_flags(tmp_path: Path, capsys) -> None:
    """--tools puts the functions in the prompt and adds the calls read (none here) to the
    JSON record; bad tool flags are clean errors."""
    model_dir = tiny_model_dir(tmp_path / "model", max_positions=1024)  # (a character per token)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]))
    base = ["generate", "abc", "--model", str(model_dir), "--max-new-tokens", "4", "--json"]
    assert main(base) == 0
    bare = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*base, "--tools", str(tools)]) == 0
    offered = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offered["tool_calls"] == [] and offered["prompt_tokens"] > bare["prompt_tokens"] + 50
    assert main([*base, "--tools", str(tools), "--tool-choice", "none"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt_tokens"] == bare["prompt_tokens"]
    for extra, message in ((["--tool-choice", "required"], "--tool-choice needs --tools"),
                           (["--tools", str(tools), "--tool-choice", "find"], "--tool-choice names 'find'"),
                           (["--tools", "[{}]"], "--tools tools[0]"),
                           (["--tools", "{oops"], "--tools: not a JSON list"),
                           (["--tools", str(tools), "--no-chat"], "needs the chat template"),
                           (["--tools", str(tools), "--tool-choice", "lookup", "--regex", "a"],
                            "fixes the answer's form")):
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_generate_jsonl_formats_and_batches(model_dir: Path, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in ({"prompt": "abc abc abc"}, {"messages": [{"role": "user", "content": "hi"}]}, {"turns": ["one", "two"]})
        )
    )
    common = ["--prompts", str(prompts), "--model", str(model_dir), "--max-new-tokens", "10", "--json"]
    assert main(["generate", *common, "--batch-size", "3"]) == 0
    batched = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert main(["generate", *common, "--drafter", "none"]) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in alone]
    assert len(batched) == 3


def test_python_api_generate_and_stream(model_dir: Path) -> None:
    sot = SoT.load(str(model_dir), drafter="pld", dtype="float32")
    out = sot.generate(["abcabcabc"], max_new_tokens=16, chat=False, ignore_eos=True)
    assert out[0].new_tokens == 16
    streamed = list(sot.stream(["abcabcabc"], max_new_tokens=16, chat=False, ignore_eos=True))
    assert sum(len(e.token_ids) for e in streamed) == 16
    assert "".join(e.text for e in streamed) == out[0].text
    assert streamed[-1].finished
    # a prompt that continues the first one's answer takes its rows from the prefix cache
    ids = sot.encode("abcabcabc", chat=False)
    again = sot.generate_ids([ids + out[0].token_ids + ids], sot.params(max_new_tokens=4))[0]
    assert out[0].cached_tokens == 0 and again.cached_tokens >= len(ids) + 15


def test_auto_drafter_is_suffix_without_a_fitting_predictor(model_dir: Path) -> None:
    """The shipped predictor does not fit the tiny model, so auto means suffix trees with
    prompt lookup, with a store of earlier answers."""
    from sot.drafters import DrafterKind

    sot = SoT.load(str(model_dir), dtype="float32")
    assert sot.engine.drafter.kind is DrafterKind.SUFFIX and sot.suffix_stores is not None
    assert SoT.load(str(model_dir), drafter="pld", dtype="float32").suffix_stores is None


def test_stop_strings_end_generation(model_dir: Path) -> None:
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    free = sot.generate(["abcabc"], max_new_tokens=30, chat=False, ignore_eos=True)[0]
    stop = free.text[3:5]
    stopped = sot.generate(["abcabc"], max_new_tokens=30, chat=False, stop=[stop], ignore_eos=True)[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


@pytest.mark.parametrize("drafter", ["pld", "suffix"])
def test_stop_strings_end_speculative_runs_where_plain_decoding_ends(model_dir: Path, drafter: str,
                                                                     monkeypatch) -> None:
    """A stop string completed inside an accepted run ends the answer at that token: the same
    tokens and finish reason as plain decoding, for stops at many places in the answer."""
    from sot.policy import PolicyConfig, PolicyKind
    from sot.requests import LiveRequest

    cut_runs = []
    commit = LiveRequest.commit

    def counting(self, tokens, *args, **kwargs):  # counts runs cut short by a stop string
        event = commit(self, tokens, *args, **kwargs)
        cut_runs.append(event.finish_reason == "stop" and len(event.token_ids) < len(tokens))
        return event

    monkeypatch.setattr(LiveRequest, "commit", counting)
    plain = SoT.load(str(model_dir), drafter="none", dtype="float32")
    # a static tree drafts every step, however the tiny model's timings look
    spec = SoT.load(str(model_dir), drafter=drafter, dtype="float32", policy=PolicyConfig(kind=PolicyKind.STATIC))
    prompt = "abcabcabcabc"
    free = spec.generate([prompt], max_new_tokens=40, chat=False, ignore_eos=True)[0]
    assert max(free.accept_lengths) >= 3, "the drafter must accept runs for the test to mean anything"
    for at in range(2, len(free.text) - 2, 3):  # (6 characters: most first occur inside a run)
        kwargs = dict(max_new_tokens=40, chat=False, ignore_eos=True, stop=[free.text[at : at + 6]])
        want = plain.generate([prompt], **kwargs)[0]
        got = spec.generate([prompt], **kwargs)[0]
        assert (got.token_ids, got.finish_reason, got.text) == (want.token_ids, want.finish_reason, want.text)
    assert sum(cut_runs) > 0, "some stop strings must fall inside an accepted run"


def test_missing_model_is_a_clean_error() -> None:
    res = run_cli("generate", "hi", "--model", "/no/such/model")
    assert res.returncode == 2
    assert "model path does not exist" in res.stderr
    assert "Traceback" not in res.stderr


def test_unknown_prompt_set_is_refused_before_any_model_loads(tmp_path: Path, capsys) -> None:
    """The message names every built-in set, multi-turn ones too; no model is loaded for it
    (the model path does not exist, so a load would fail with another message)."""
    rc = main(["bench", "--prompts", "no-such-set", "--model", "/no/such/model", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown prompt set 'no-such-set'" in err
    assert "agent-loop" in err and "sharegpt-heldout" in err and "model path" not in err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(monkeypatch, capsys) -> None:
    """``sot generate ... | head``: the closed pipe ends the command with 141 (128 + SIGPIPE, as
    a pipeline's tools end) and no error line."""
    import sot.cli as cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.HANDLERS, "generate", closed)
    assert main(["generate", "hello"]) == 141
    assert capsys.readouterr().err == ""


def test_more_threads_than_cpus_is_warned_of() -> None:
    import argparse
    import warnings

    from sot.cli.common import apply_threads
    from sot.machine import usable_cpus

    before = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match=f"--threads {usable_cpus() + 1} is more than the {usable_cpus()} CPU"):
            apply_threads(argparse.Namespace(threads=usable_cpus() + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            apply_threads(argparse.Namespace(threads=usable_cpus()))
        from sot import SoT
        from sot.errors import ConfigError, SoTError

        with pytest.raises(ConfigError, match="threads"):  # (the library's own setting, checked the same way)
            SoT.load("/no/such/model", threads=0)
        with pytest.warns(UserWarning, match=f"threads {usable_cpus() + 1} is more than"), \
                pytest.raises(SoTError, match="model path does not exist"):
            SoT.load("/no/such/model", threads=usable_cpus() + 1)
        assert torch.get_num_threads() == usable_cpus() + 1
    finally:
        torch.set_num_threads(before)


def test_help_states_each_default_and_no_command_shows_the_commands(capsys) -> None:
    import re as re_

    subs = {a.dest: a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)}["command"]
    text = re_.sub(r"\s+", " ", subs.choices["generate"].format_help())
    assert "--max-new-tokens MAX_NEW_TOKENS tokens each answer generates at most (default: 128)" in text
    assert "--warmup WARMUP tokens decoded plainly at the start of a sequence (default: 0)" in text
    assert "--stop STOP stop string (repeatable) --prediction" in text, "an empty default is not stated"
    assert "0 = greedy (default) --top-p" in text, "a text that says its default is left as it is"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sot") and "generate" in err and "bench-serve" in err


def test_bad_flag_value_is_a_clean_error() -> None:
    res = run_cli("generate", "hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" not in res.stdout
    assert "must be >= 0" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("generate", "hi", "--drafter", "magic")
    assert res.returncode == 2 and "invalid choice" in res.stderr
    with pytest.raises(SystemExit) as exc:  # (before anything loads)
        build_parser().parse_args(["train", "gen-data", "--out", "x.jsonl", "--temperature", "nan"])
    assert exc.value.code == 2


def test_an_unknown_flag_is_named_by_the_subcommand_that_refused_it(capsys) -> None:
    """Its --help is the one that lists what the (sub)command takes."""
    for argv, prog in ((["generate", "hi", "--max-tokens", "8"], "sot generate"), (["chat", "hello"], "sot chat"),
                       (["train", "fit", "--data", "d", "--out", "o", "--bogus"], "sot train fit")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and err.startswith(f"{prog}: error: unrecognized arguments: "), err
        assert err.endswith(f"(see '{prog} --help')"), err


@pytest.mark.parametrize("flag,value,message", [("--logprobs", "25", "must be 0 to 20"),
                                                ("--frequency-penalty", "3", "must be -2 to 2"),
                                                ("--repetition-penalty", "0", "must be > 0"),
                                                ("--logit-bias", "5=200", "BIAS must be -100 to 100")])
def test_range_flags_are_checked_by_name_before_loading(flag: str, value: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--model", "/no/such/model", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}: {message}" in err


def test_prompt_longer_than_context(model_dir: Path, capsys) -> None:
    rc = main(["generate", "x" * 150, "--model", str(model_dir), "--max-new-tokens", "20", "--no-chat"])
    assert rc == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    with pytest.raises(PromptTooLongError):
        sot.generate(["x" * 150], max_new_tokens=20, chat=False)


def test_bad_prompt_file(tmp_path: Path, model_dir: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    assert main(["generate", "--prompts", str(bad), "--model", str(model_dir)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["generate", "--prompts", str(tmp_path / "missing.jsonl")]) == 2


def test_settings_on_prompt_lines_are_named_as_unread(tmp_path: Path, capsys) -> None:
    """A prompts file sets no request settings: a line that carries some (as OpenAI batch lines
    do) gets one warning line naming them, and the command goes on with its own settings."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "max_tokens": 5}\n{"prompt": "c", "temperature": 0}\n')
    assert main(["generate", "--prompts", str(path), "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert "sot: warning: " in err and "max_tokens (line 2), temperature (line 3)" in err and "id (line" not in err
    assert "UserWarning" not in err and "prompts.py" not in err  # one line for a user, not the code's place
    path.write_text('{"prompt": "a", "id": 1}\n')
    assert main(["generate", "--prompts", str(path), "--model", str(tmp_path / "no-model")]) == 2
    assert "warning" not in capsys.readouterr().err


def test_incompatible_models(tmp_path: Path) -> None:
    not_model = tmp_path / "empty"
    not_model.mkdir()
    with pytest.raises(ModelLoadError):
        SoT.load(str(not_model))
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ModelLoadError):
        SoT.load(str(tmp_path / "file.bin"))
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)).save_pretrained(t5)
    with pytest.raises(UnsupportedModelError):
        SoT.load(str(t5))


def test_api_argument_errors(model_dir: Path) -> None:
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    for kwargs in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"max_new_tokens": 0}, {"sampling": "magic"},
                   {"min_p": 1.5}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"stop": ""},
                   {"stop": [1]}, {"stop": None}, {"logprobs": True}, {"logprobs": "3"}, {"logit_bias": [1, 2]},
                   {"logit_bias": {"abc": 1}}, {"logit_bias": {5.7: 1}}, {"repetition_penalty": "1.1"},
                   {"presence_penalty": None}, {"seed": "1"}, {"seed": 1.0}, {"batch_size": "2"},
                   {"batch_size": 1.5}):
        with pytest.raises(ConfigError):
            sot.generate(["a"], chat=False, **kwargs)
    # the step-level engine checks what it is given as well: a bad request fails alone
    from sot.requests import GenerationParams
    from sot.sampling import SamplingParams

    for params in (GenerationParams(sampling=SamplingParams(temperature=1.0, top_p=0.0)), GenerationParams(stop="ab"),
                   GenerationParams(sampling=SamplingParams(temperature=-1.0)), None):
        with pytest.raises(ConfigError):
            sot.engine.add_request([5, 6], params)
    with pytest.raises(ConfigError, match="list of token ids"):
        sot.engine.add_request(None, GenerationParams())
    assert not sot.engine.has_unfinished()
    unseeded = [sot.generate("a", chat=False, temperature=1.0, seed=None, max_new_tokens=12, ignore_eos=True)[0]
                .token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1, "seed None draws a fresh seed each time"
    with pytest.raises(ConfigError):
        SoT.load(str(model_dir), dtype="float16")
    with pytest.raises(ConfigError):
        SoT.load(str(model_dir), drafter="magic")
    with pytest.raises(ConfigError, match="model must be"):
        SoT.load(None)
    # wrong types that read as true or false, or as a batch of one, are refused by name
    with pytest.raises(ConfigError, match="chat must be"):
        sot.generate("a", chat=1)
    with pytest.raises(ConfigError, match="trace must be"):
        sot.generate("a", chat=False, trace="yes")
    with pytest.raises(ConfigError, match="prompts must be a list"):
        sot.generate_ids(torch.tensor([[5, 6, 7]]), GenerationParams())
    with pytest.raises(ConfigError, match="eos_token_ids"):
        sot.generate_ids([[5, 6]], GenerationParams(eos_token_ids=2))


def test_chat_session(model_dir: Path, tmp_path: Path) -> None:
    """Each line is a turn; a turn that cannot run (past the context) is reported and dropped
    and the session goes on; /reset and /help are commands, not messages, and an empty line
    is skipped; the answers alone go
    to stdout; the earlier-answers store is written at the end."""
    store = tmp_path / "answers.store"
    res = subprocess.run(
        [sys.executable, "-m", "sot.cli", "chat", "--model", str(model_dir), "--max-new-tokens", "8",
         "--ignore-eos", "--suffix-store", str(store)],
        input="hello\n" + "x" * 200 + "\n/help\n\nagain\n/reset\nhello\n/reste\n/reset\n" + "y" * 138
              + "\n/exit\nnever sent\n",
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("bot> ") == 5 and res.stderr.count("tok/s") == 4 and "bot> " not in res.stdout
    assert "exceeds the model's context of 160 tokens; /reset starts a new conversation" in res.stderr
    assert "/reset   start a new conversation" in res.stderr and "[new conversation]" in res.stderr
    assert "unknown command /reste (/help lists them; //reste sends it as a message)" in res.stderr
    # a turn with less room left than --max-new-tokens answers up to the context's end
    assert re.search(r"\[[1-7] tokens, .* tok/s, the context is full: /reset starts", res.stderr), res.stderr
    answers = res.stdout.splitlines()
    assert len(answers) == 4 and answers[0] == answers[2], "after /reset the first turn is asked again afresh"
    assert store.is_file() and "Traceback" not in res.stderr


def test_chat_lines_commands_and_messages() -> None:
    from sot.cli.generate import chat_line

    assert [chat_line(x)[0] for x in ("", "  ", "/exit", "/QUIT", "/help", " /reset ")] == \
        ["skip", "skip", "exit", "exit", "help", "reset"]
    assert chat_line("/reste") == ("unknown", "/reste")
    assert chat_line("//reste") == ("message", "/reste")
    assert chat_line("/usr/bin holds what?") == ("message", "/usr/bin holds what?")
    assert chat_line("what is 2/3?") == ("message", "what is 2/3?")


def test_chat_writes_its_store_when_terminated(model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (a terminal closed, a supervisor stopping it) ends a chat as /exit does: the
    earlier-answers store is written."""
    import signal

    store = tmp_path / "answers.store"
    proc = subprocess.Popen([sys.executable, "-m", "sot.cli", "chat", "--model", str(model_dir),
                             "--max-new-tokens", "8", "--ignore-eos", "--suffix-store", str(store)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        err = ""
        while "tok/s" not in err:  # the answer is done; the session waits for the next line
            line = proc.stderr.readline()
            assert line, err
            err += line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert store.is_file() and "Traceback" not in proc.stderr.read()


def test_chat_needs_a_chat_template(tmp_path: Path) -> None:
    folder = tiny_model_dir(tmp_path / "base")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    res = run_cli("chat", "--model", str(folder))
    assert res.returncode == 2 and "has no chat template" in res.stderr and "--chat-template" in res.stderr


def test_stream_reports_statistics(model_dir: Path) -> None:
    sot = SoT.load(str(model_dir), drafter="pld", dtype="bfloat16")
    events = list(sot.stream(["abcabcabc"], max_new_tokens=12, chat=False, ignore_eos=True))
    assert sum(len(e.token_ids) for e in events) == 12
    stats = sot.last_stream[0]
    assert stats.new_tokens == 12 and stats.steps >= 1 and stats.mean_accept_len >= 1.0


def test_auto_dtype_rule_follows_native_bf16_support(monkeypatch, model_dir: Path) -> None:
    """The rule (training commands, and ``SOT_DTYPE_AUTO=rule`` instead of measuring) takes
    bfloat16 only where the CPU multiplies it in hardware (AMX or AVX512-BF16) and float32
    elsewhere; explicit names are kept, unknown ones are refused."""
    import torch

    from sot.models.loading import native_bf16, resolve_dtype

    monkeypatch.setenv("SOT_DTYPE_AUTO", "rule")
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    for amx, avx512_bf16, want in [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                   (False, False, torch.float32)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert native_bf16("cpu") is (want is torch.bfloat16)
        assert resolve_dtype("auto") is want
        assert SoT.load(str(model_dir), drafter="none").target.model.dtype is want
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16"):
        resolve_dtype("float16")
    # the parsers' torch-free list names exactly the values the loader resolves
    from sot.cli import DTYPE_CHOICES
    from sot.models.loading import DTYPE_CHOICES as LOADER_CHOICES
    assert sorted(DTYPE_CHOICES) == sorted(LOADER_CHOICES)


def test_parser_defaults_come_from_the_config_dataclasses() -> None:
    """Every default a user can set from the command line is the dataclass's own: no
    subcommand restates one."""
    import argparse
    import inspect

    from sot.api import SoT
    from sot.bench.runner import BenchConfig
    from sot.cli import build_parser
    from sot.drafters import DRAFT_TOP_K, TreeBudget, make_drafter
    from sot.drafters.state import StateDrafter
    from sot.policy import PolicyConfig
    from sot.requests import GenerationParams
    from sot.sampling import SamplingParams
    from sot.server.app import ServerConfig

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    expected = {
        "max_nodes": TreeBudget.max_nodes, "max_depth": TreeBudget.max_depth, "draft_top_k": DRAFT_TOP_K,
        "policy": PolicyConfig.kind.value, "warmup": PolicyConfig.warmup,
        "fallback_threshold": PolicyConfig.fallback_threshold, "disable_above": PolicyConfig.disable_above,
        "policy_model": PolicyConfig.model_path,
    }
    sampling = {"max_new_tokens": GenerationParams.max_new_tokens, "temperature": SamplingParams.temperature,
                "top_p": SamplingParams.top_p, "top_k": SamplingParams.top_k, "seed": SamplingParams.seed,
                "sampling": SamplingParams.mode.value, "min_p": SamplingParams.min_p}
    checked = 0
    for name in ("generate", "chat", "serve", "bench", "trace"):
        defaults = {a.dest: a.default for a in subs[name]._actions}
        want = dict(expected)
        if name in ("generate", "chat", "trace"):
            want.update(sampling)
        if name == "bench":
            want.update(max_new_tokens=BenchConfig.max_new_tokens, temperature=BenchConfig.temperature,
                        seed=BenchConfig.seed, sampling=BenchConfig.sampling)
            assert "--top-k" not in subs[name]._option_string_actions, "bench's draft width is --draft-top-k only"
        if name == "serve":
            want.update(max_batch=ServerConfig.max_batch, max_queue=ServerConfig.max_queue,
                        shutdown_timeout=ServerConfig.shutdown_timeout, trace=ServerConfig.trace,
                        prompt_budget=ServerConfig.prompt_budget)
        for dest, value in want.items():
            assert defaults[dest] == value, (name, dest, defaults[dest], value)
            checked += 1
    train = {a.dest: a for a in subs["train"]._actions if isinstance(a, argparse._SubParsersAction)}["train_command"]
    from sot.train.acceptance import PolicyTrainConfig
    from sot.train.trainer import TrainConfig

    for sub_name, config in (("fit", TrainConfig), ("policy", PolicyTrainConfig)):
        for action in train.choices[sub_name]._actions:
            if action.dest in ("help", "data", "out") or not hasattr(config, action.dest):
                continue
            want_value = getattr(config, action.dest)
            if action.dest in ("temperatures", "batch_sizes"):
                want_value = ",".join(f"{t:g}" for t in want_value)
            assert action.default == want_value, (sub_name, action.dest, action.default, want_value)
            checked += 1
    assert checked > 80
    assert BenchConfig.max_new_tokens == GenerationParams.max_new_tokens and BenchConfig.draft_top_k == DRAFT_TOP_K
    # the library's own entry points take the same defaults
    load = inspect.signature(SoT.load).parameters
    assert (load["max_nodes"].default, load["max_depth"].default, load["top_k"].default) == \
        (TreeBudget.max_nodes, TreeBudget.max_depth, DRAFT_TOP_K)
    assert inspect.signature(make_drafter).parameters["top_k"].default == DRAFT_TOP_K
    assert inspect.signature(StateDrafter).parameters["top_k"].default == DRAFT_TOP_K
    params = inspect.signature(SoT.params).parameters
    assert (params["max_new_tokens"].default, params["temperature"].default, params["top_p"].default,
            params["top_k"].default, params["seed"].default) == (
        GenerationParams.max_new_tokens, SamplingParams.temperature, SamplingParams.top_p, SamplingParams.top_k,
        SamplingParams.seed)


def test_suffix_store_carries_answers_across_runs(model_dir: Path, tmp_path: Path, capsys) -> None:
    """``--suffix-store``: a run writes its answers; the next reads them and drafts from them
    (the repeated prompt's answer comes in far fewer steps, and is the same)."""
    from sot.drafters import SuffixStores

    store = tmp_path / "answers.store"
    args = ["generate", "count: 1 2 3 4 5", "--model", str(model_dir), "--max-new-tokens", "30", "--json",
            "--ignore-eos", "--drafter", "suffix", "--suffix-store", str(store)]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    loaded = SuffixStores()
    loaded.load(store)
    assert loaded.tokens >= 30
    assert main(args) == 0
    captured = capsys.readouterr()
    second = json.loads(captured.out)
    assert second["token_ids"] == first["token_ids"]
    assert second["steps"] < first["steps"] // 2
    assert "suffix store written" in captured.err
    assert main(["generate", "hi", "--model", str(model_dir), "--drafter", "pld", "--suffix-store", str(store)]) == 2


def test_the_parser_needs_no_web_framework() -> None:
    """``sot generate`` and the other commands parse their flags where FastAPI is missing (a
    GPU image, say); only ``sot serve`` itself needs it."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'starlette', 'uvicorn'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from sot.cli import build_parser\n"
        "print(build_parser().parse_args(['generate', 'hi', '--device', 'cpu']).device)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cpu"


def test_a_prompt_from_standard_input_and_empty_inputs(model_dir: Path, capsys, monkeypatch) -> None:
    """PROMPT (and score's TEXT) '-' is read from standard input, and answers as the prompt
    given inline; an empty stop string and an empty TEXT to score are refused before a load."""
    import io

    base = ["--model", str(model_dir), "--no-chat", "--max-new-tokens", "6", "--ignore-eos", "--json",
            "--drafter", "pld"]
    assert main(["generate", "ab ab ab", *base]) == 0
    inline = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("ab ab ab".encode())))
    assert main(["generate", "-", *base]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == inline["token_ids"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab \xff")))
    assert main(["generate", "-", *base]) == 2
    assert "PROMPT from standard input: not UTF-8 text" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--model", "/no/such/model", "--stop", ""])
    assert exc.value.code == 2 and "argument --stop: a stop string cannot be empty" in capsys.readouterr().err
    assert main(["score", "", "--model", "/no/such/model"]) == 2
    assert "TEXT is empty" in capsys.readouterr().err


def test_threads_sets_the_passes_threads(model_dir: Path, capsys) -> None:
    """``--threads N`` runs the passes on N threads (PyTorch's own count without it); the
    answer does not depend on it (each row's sums keep their order whatever splits the work)."""
    import torch

    base = ["generate", "ab ab ab", "--model", str(model_dir), "--no-chat", "--max-new-tokens", "6", "--ignore-eos",
            "--json", "--drafter", "pld", "--dtype", "float32"]
    before = torch.get_num_threads()
    try:
        assert main(base) == 0
        assert torch.get_num_threads() == before
        default = json.loads(capsys.readouterr().out)["token_ids"]
        assert main([*base, "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert json.loads(capsys.readouterr().out)["token_ids"] == default
    finally:
        torch.set_num_threads(before)
    assert build_parser().parse_args(["bench", "--threads", "3"]).threads == 3


def test_generate_prints_each_answer_as_it_finishes_and_keeps_them_on_ctrl_c(model_dir: Path, tmp_path: Path,
                                                                             capsys, monkeypatch) -> None:
    """A prompts file prints its answers in order as they finish, so Ctrl-C loses none that
    finished (those held back behind an unfinished earlier prompt are printed then too), and
    standard input works as the file."""
    import io

    prompts = [f"{w} {w} {w}" for w in ("ab", "cd", "ef")]
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\ufeff" + lines).encode())))  # (a BOM too)
    base = ["--model", str(model_dir), "--no-chat", "--max-new-tokens", "8", "--ignore-eos", "--json",
            "--drafter", "pld", "--batch-size", "3"]
    assert main(["generate", "--prompts", "-", *base]) == 0
    whole = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in whole] == [0, 1, 2]
    real = SoT.generate_ids

    def interrupted(self, ids, params, batch_size=1, trace=False, on_done=None):
        seen = []

        def stop_after_two(i, completion):
            on_done(i, completion)
            seen.append(i)
            if len(seen) == 2:
                raise KeyboardInterrupt

        return real(self, ids, params, batch_size, trace, stop_after_two)

    monkeypatch.setattr(SoT, "generate_ids", interrupted)
    (tmp_path / "p.jsonl").write_text(lines)
    assert main(["generate", "--prompts", str(tmp_path / "p.jsonl"), *base]) == 130
    kept = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(kept) == 2 and len({r["index"] for r in kept}) == 2
    assert all((r["text"], r["token_ids"]) == (whole[r["index"]]["text"], whole[r["index"]]["token_ids"]) for r in kept)
    # a trace asked for keeps the finished answers too, under their places in the run
    from sot.trace import read_trace

    trace = tmp_path / "stopped.jsonl"
    assert main(["generate", "--prompts", str(tmp_path / "p.jsonl"), *base, "--trace", str(trace)]) == 130
    kept = {r["index"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    _, traced = read_trace(trace)
    assert len(traced) == 2 and {t.index: t.token_ids for t in traced} == {i: r["token_ids"] for i, r in kept.items()}


def test_serve_refuses_an_empty_api_key_and_bad_loading_options(monkeypatch, capsys) -> None:
    """An unset variable in --api-key "$KEY" would leave a server that a bare 'Bearer' opens."""
    assert main(["serve", "--api-key", "", "--model", "/no/such/model"]) == 2
    assert "the API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("SOT_API_KEY", "  ")
    assert main(["serve", "--model", "/no/such/model"]) == 2
    assert "the API key is empty" in capsys.readouterr().err
    monkeypatch.delenv("SOT_API_KEY")
    assert main(["serve", "--served-model-name", " ", "--model", "/no/such/model"]) == 2
    assert "--served-model-name is empty" in capsys.readouterr().err
    # loading options that cannot work are refused before the port is taken, not as a failed load
    for flags, message in ((["--predictor", "/no/such/head"], "--predictor /no/such/head: no such file"),
                           (["--chat-template", "no-such-template"], "not a Jinja template"),
                           (["--suffix-store", "/no/such/dir/s.npz"], "does not exist")):
        assert main(["serve", "--model", "/no/such/model", "--port", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "listening" not in err, err


def test_ctrl_c_while_the_command_line_loads_is_one_line(monkeypatch, capsys) -> None:
    """The ``sot`` entry point loads the command line (and torch) inside its own Ctrl-C
    handler, and ``import sot`` alone loads nothing heavy."""
    class Interrupted:
        def find_spec(self, name, path=None, target=None):
            if name == "sot.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "sot.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    from sot._entry import main as entry

    assert entry(["--version"]) == 130
    assert capsys.readouterr().err.strip() == "sot: interrupted"
    light = subprocess.run([sys.executable, "-c", "import sys, sot; print('torch' in sys.modules, sot.__version__)"],
                           capture_output=True, text=True, check=True)
    assert light.stdout.split() == ["False", "0.1.0"]
