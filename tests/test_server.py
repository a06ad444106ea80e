"""``sot serve`` as a real subprocess on 127.0.0.1: the OpenAI client, identity with offline
``sot generate`` under concurrent load, bad input, disconnects, bursts, a bounded soak and
graceful shutdown. Load loops are bounded in count and time."""
from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from helpers import tiny_model_dir
from server_helpers import REPO, ServerProcess, free_port

MODEL = "SmolLM2-135M-Instruct"
TINY = "tiny"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """The default model with its state predictor, 4 sequences at a time."""
    server = ServerProcess("--max-batch", "4", log=tmp_path_factory.mktemp("serve") / "default.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", max_positions=512)


@pytest.fixture(scope="module")
def tiny_server(tiny_dir, tmp_path_factory):
    """A tiny random model (character tokenizer, 512-token context), prompt-lookup drafts."""
    server = ServerProcess("--model", str(tiny_dir), "--served-model-name", TINY, "--max-batch", "8",
                           "--max-queue", "64", "--api-key", "sekrit", "--trace", "2", "--log-requests",
                           "--allowed-origins", "http://app.example",
                           log=tmp_path_factory.mktemp("serve") / "tiny.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


AUTH = {"Authorization": "Bearer sekrit"}


def _chat(content: str, **kw) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": content}], **kw}


# ---------------------------------------------------------------------------- the default model
def test_openai_client_chat_completions_and_models(default_server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    assert default_server.saw_loading, "/health answered 503 while the model loaded"
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0
    pieces, reasons, usage = [], [], None
    for event in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if event.usage:
            usage = event.usage
        for c in event.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == chat.choices[0].message.content, "streamed text equals the whole answer"
    assert reasons[-1] == chat.choices[0].finish_reason and usage.completion_tokens == chat.usage.completion_tokens
    text = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == text.choices[0].text


def test_openai_client_gets_json_for_a_schema(default_server) -> None:
    """response_format json_schema and json_object: the answer parses and has the schema's
    fields, streamed or whole, and a seeded sample repeats."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = dict(model=MODEL, max_tokens=60, temperature=0,
               messages=[{"role": "user", "content": "Invent a person; give their name and age."}],
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    whole = client.chat.completions.create(**ask).choices[0]
    value = json.loads(whole.message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and whole.finish_reason == "stop"
    streamed = "".join(ev.choices[0].delta.content or "" for ev in client.chat.completions.create(**ask, stream=True)
                       if ev.choices)
    assert streamed == whole.message.content
    free = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"},
                                             "max_tokens": 100}).choices[0]
    if free.finish_reason == "stop":
        assert isinstance(json.loads(free.message.content), dict)
    else:  # (any object may go on past the limit)
        assert free.finish_reason == "length" and free.message.content.lstrip().startswith("{")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def _streamed_calls(events) -> tuple[dict[int, dict], str, str | None]:
    """Tool calls put together from a stream's deltas (by index: id, name, arguments), the
    streamed content and the finish reason."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for ev in events:
        for c in ev.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return calls, content, reason


def test_openai_client_calls_tools(default_server) -> None:
    """A named tool and ``required``: the calls parse and fit the tools' schemas, streamed or
    whole; the call and its result go back into the next turn; an ``auto`` answer that writes
    a tagged call is read as content and a call, streamed or whole."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    ask = dict(model=MODEL, max_tokens=80, temperature=0, tools=[WEATHER, CLOCK],
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    named = client.chat.completions.create(
        **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert named.finish_reason == "stop" and named.message.content is None  # (OpenAI's, for a named tool)
    (call,) = named.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    calls, content, reason = _streamed_calls(client.chat.completions.create(
        **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    assert content == "" and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]

    required = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    chosen = required.message.tool_calls[0].function
    assert chosen.name in ("get_weather", "get_time")
    assert set(json.loads(chosen.arguments)) == set(next(
        t for t in (WEATHER, CLOCK) if t["function"]["name"] == chosen.name)["function"]["parameters"]["required"])
    calls, content, reason = _streamed_calls(client.chat.completions.create(
        **ask, tool_choice="required", parallel_tool_calls=False, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (chosen.name, json.loads(chosen.arguments))] and reason == "tool_calls" and content == ""

    count = {name: httpx.post(f"{default_server.url}/tokenize", json={"messages": ask["messages"], **extra},
                              timeout=30).json()["count"]
             for name, extra in (("bare", {}), ("tools", {"tools": [WEATHER]}),
                                 ("none", {"tools": [WEATHER], "tool_choice": "none"}))}
    assert count["tools"] > count["bare"] + 50 and count["none"] == count["bare"], count
    bad = httpx.post(f"{default_server.url}/tokenize", timeout=30, json={
        "messages": ask["messages"], "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"

    turn = ask["messages"] + [named.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    follow = client.chat.completions.create(**{**ask, "messages": turn, "max_tokens": 16}).choices[0]
    assert follow.message.content or follow.message.tool_calls

    # auto: the answer is held (by a regex) to text and a tagged call, as a model trained to call would write
    tagged = 'Looking it up.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    forced = dict(**ask, tool_choice="auto", extra_body={"guided_regex": re.escape(tagged)})
    whole = client.chat.completions.create(**forced).choices[0]
    assert whole.message.content == "Looking it up.\n" and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_time", {"city": "Oslo"})]
    calls, content, reason = _streamed_calls(client.chat.completions.create(**forced, stream=True))
    assert content == "Looking it up.\n" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"city": "Oslo"})]


def test_openai_client_responses_api(default_server) -> None:
    """/v1/responses: the answer of the chat completion it means, whole and streamed (the
    client's typed events put together give the same text and usage); a function call as an
    output item, fed back as input items; unsupported fields named."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a large river."}])
    ask = dict(model=MODEL, max_output_tokens=24, temperature=0, instructions="Answer briefly.",
               input="Name a large river.")
    whole = client.responses.create(**ask)
    assert whole.output_text == chat.choices[0].message.content and whole.object == "response"
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    kinds, numbers, text, done = [], [], "", None
    for event in client.responses.create(**ask, stream=True):
        kinds.append(event.type)
        numbers.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert text == whole.output_text == done.output_text and done.usage.output_tokens == whole.usage.output_tokens
    assert numbers == list(range(len(kinds)))

    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
            "parameters": WEATHER["function"]["parameters"]}
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                     temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    streamed = [e for e in client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                                   tool_choice={"type": "function", "name": "get_weather"},
                                                   max_output_tokens=60, temperature=0, stream=True)]
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and streamed[-1].response.output[0].arguments == call.arguments
    follow = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, tools=[tool], input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output
    for extra in ({"conversation": "conv_1"}, {"input": [{"type": "input_image", "image_url": "x"}]}):
        with pytest.raises(BadRequestError) as err:
            client.responses.create(**{**ask, **extra})
        assert err.value.status_code == 400


def test_openai_client_reads_logprobs(default_server) -> None:
    """Log probabilities in OpenAI's formats: the reported tokens spell the returned text
    (a stop string cuts both), a greedy token is its position's most likely one, and a
    stream reports what the whole answer does."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16,
               temperature=0, logprobs=True, top_logprobs=3)
    chat = client.chat.completions.create(**ask).choices[0]
    content = chat.logprobs.content
    assert "".join(t.token for t in content) == chat.message.content and len(content) > 3
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob == tops[0] <= 0
        assert bytes(t.bytes).decode("utf-8") == t.token
    streamed = [(t.token, t.logprob) for ev in client.chat.completions.create(**ask, stream=True)
                for c in ev.choices if c.logprobs and c.logprobs.content for t in c.logprobs.content]
    assert streamed == [(t.token, t.logprob) for t in content]
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=2)
    stop = free.choices[0].text[4:6]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=2,
                                    stop=[stop]).choices[0]
    lp = cut.logprobs
    assert cut.text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert "".join(lp.tokens).startswith(cut.text) and len("".join(lp.tokens[:-1])) < len(cut.text) or not cut.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(set(top) >= {tok} for tok, top in zip(lp.tokens, lp.top_logprobs))


def test_echo_scores_a_text_with_the_figures_generation_gives(default_server) -> None:
    """``echo`` with ``max_tokens`` 0 returns the prompt alone with its tokens' log
    probabilities (the first has none): a token scored in a prompt has the log probability
    it gets when generated there. With tokens asked for, the prompt comes first, streamed too."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    head = "The capital of France is"
    gen = client.completions.create(model=MODEL, prompt=head, max_tokens=2, temperature=0, logprobs=1).choices[0]
    first = gen.logprobs.tokens[0]
    scored = client.completions.create(model=MODEL, prompt=head + first, max_tokens=0, echo=True, logprobs=1)
    ch = scored.choices[0]
    assert ch.text == head + first and scored.usage.completion_tokens == 0
    assert "".join(ch.logprobs.tokens) == head + first and ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.tokens[-1] == first and ch.logprobs.token_logprobs[-1] == gen.logprobs.token_logprobs[0]
    both = client.completions.create(model=MODEL, prompt=head, max_tokens=2, temperature=0, echo=True).choices[0]
    assert both.text == head + gen.text
    streamed = "".join(ev.choices[0].text for ev in client.completions.create(
        model=MODEL, prompt=head, max_tokens=2, temperature=0, echo=True, stream=True) if ev.choices)
    assert streamed == both.text
    ask = dict(model=MODEL, prompt=head, max_tokens=3, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**ask).choices[0]
    lp = whole.logprobs
    assert whole.text.startswith(head) and len(lp.tokens) == len(lp.text_offset) > 3
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [ev.choices[0] for ev in client.completions.create(**ask, stream=True) if ev.choices]
    assert chunks[0].text == head and len(chunks[0].logprobs.tokens) == len(scored.choices[0].logprobs.tokens) - 1
    assert "".join(c.text for c in chunks) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.logprobs for x in getattr(c.logprobs, key)] == getattr(lp, key), key
    # max_tokens 0 streamed: the token decoded to end the prompt's pass is not the answer's
    ask = {"model": MODEL, "prompt": head, "max_tokens": 0, "echo": True, "return_token_ids": True}
    whole = httpx.post(f"{default_server.url}/v1/completions", json=ask, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{default_server.url}/v1/completions", json={**ask, "stream": True}, timeout=60) as r:
        ids = [t for line in r.iter_lines() if line.startswith("data: {")
               for ch in json.loads(line[6:])["choices"] for t in ch.get("token_ids") or []]
    assert whole["token_ids"] == [] and ids == []


def test_n_samples_and_prompt_lists_are_choices_in_order(default_server) -> None:
    """``n`` samples of a seeded request: distinct, the same every time, streamed as they are
    returned whole, sample 0 equal to the same request with ``n = 1``; a list of prompts gives
    one choice per prompt, each the answer that prompt gets alone; usage counts each prompt once."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=1.0,
               seed=4)
    three = client.chat.completions.create(**ask, n=3)
    texts = [c.message.content for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.message.content for c in client.chat.completions.create(**ask, n=3).choices] == texts
    assert client.chat.completions.create(**ask).choices[0].message.content == texts[0]
    parts: dict[int, list[str]] = {}
    for ev in client.chat.completions.create(**ask, n=3, stream=True):
        for c in ev.choices:
            parts.setdefault(c.index, []).append(c.delta.content or "")
    assert ["".join(parts[i]) for i in range(3)] == texts
    single = client.chat.completions.create(**ask)
    assert three.usage.prompt_tokens == single.usage.prompt_tokens
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3,"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "Explain recursion to a child in two sentences.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about autumn rain.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Give me a regular expression that matches an email address.",
    "What does HTTP status 429 mean?",
    "Write a SQL query that counts rows per day.",
]


def _offline(prompts: list[str], tmp_path, *flags: str) -> list[list[int]]:
    """``sot generate --json`` token ids of each prompt (one call, prompt i has index i)."""
    path = tmp_path / f"prompts-{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = subprocess.run([sys.executable, "-m", "sot.cli", "generate", "--prompts", str(path), "--json", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["token_ids"] for line in out.stdout.splitlines()]


async def _served_tokens(url: str, body: dict, delay: float) -> list[int]:
    await asyncio.sleep(delay)
    async with httpx.AsyncClient(timeout=300) as client:
        tokens = []
        async with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        tokens += c.get("token_ids", [])
        return tokens


def test_concurrent_requests_equal_offline_generate(default_server, tmp_path) -> None:
    """12 greedy requests of mixed lengths, started at random offsets, each equal
    ``sot generate`` token for token (a greedy answer cut at k tokens is the first k tokens
    of a longer one); the same seeded request sent twice, at different moments, equals its
    offline seeded sample both times, once naming ``coupled`` and once by default (one
    offline call: each costs a model load)."""
    rng = random.Random(3)
    limits = [rng.choice([8, 16, 24, 40, 56]) for _ in PROMPTS]
    reference = _offline(PROMPTS, tmp_path, "--max-new-tokens", str(max(limits)))
    coupled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--max-new-tokens", "24"]
    coupled_ref = _offline(PROMPTS[:1], tmp_path, *coupled)[0]

    def body(prompt: str, **kw) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "return_token_ids": True, **kw}

    bodies = [body(p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, limits)]
    bodies += [body(PROMPTS[0], max_tokens=24, temperature=0.9, top_p=0.95, seed=7, **mode)
               for mode in ({"sampling_mode": "coupled"}, {})]
    delays = [rng.uniform(0, 1.5) for _ in bodies]

    async def run_all():
        return await asyncio.gather(*(_served_tokens(default_server.url, b, d) for b, d in zip(bodies, delays)))

    served = asyncio.run(run_all())
    for i, (ref, n) in enumerate(zip(reference, limits)):
        assert served[i] == ref[:n], f"request {i} differs from sot generate"
    assert served[len(PROMPTS):] == [coupled_ref] * 2, "seeded coupled samples differ from sot generate"


# ---------------------------------------------------------------------------- the tiny model
BAD = [
    ("malformed JSON", b"{not json", 400),
    ("not an object", b"[1, 2]", 400),
    ("no messages", json.dumps({"model": TINY}).encode(), 400),
    ("empty messages", json.dumps({"model": TINY, "messages": []}).encode(), 400),
    ("messages of the wrong type", json.dumps({"model": TINY, "messages": "hi"}).encode(), 400),
    ("max_tokens of the wrong type", json.dumps(_chat("hi", max_tokens="ten")).encode(), 400),
    ("unknown model", json.dumps({**_chat("hi"), "model": "gpt-9"}).encode(), 404),
    ("max_tokens 0", json.dumps(_chat("hi", max_tokens=0)).encode(), 400),
    ("max_tokens above the context", json.dumps(_chat("hi", max_tokens=600)).encode(), 400),
    ("prompt longer than the context", json.dumps(_chat("x" * 700, max_tokens=4)).encode(), 400),
    ("n = 0", json.dumps(_chat("hi", n=0)).encode(), 400),
    ("more choices than allowed", json.dumps(_chat("hi", n=17)).encode(), 400),
    ("temperature out of range", json.dumps(_chat("hi", temperature=2.5)).encode(), 400),
    ("negative temperature", json.dumps(_chat("hi", temperature=-1)).encode(), 400),
    ("min_p above 1", json.dumps(_chat("hi", min_p=1.5)).encode(), 400),
    # OpenAI features the server does not provide are refused, not silently ignored
    ("top_logprobs without logprobs", json.dumps(_chat("hi", top_logprobs=2)).encode(), 400),
    ("too many top_logprobs", json.dumps(_chat("hi", logprobs=True, top_logprobs=21)).encode(), 400),
    ("an invalid regex", json.dumps(_chat("hi", guided_regex="[a-")).encode(), 400),
    ("two forms of output", json.dumps(_chat("hi", guided_regex="a+", guided_choice=["b"])).encode(), 400),
    ("a schema that is not an object", json.dumps(_chat("hi", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": "no"}})).encode(), 400),
    ("a tool without a valid name", json.dumps(_chat("hi", tools=[{"type": "function", "function": {
        "name": "two words"}}])).encode(), 400),
    ("tool_choice naming no listed tool", json.dumps(_chat("hi", tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}})).encode(), 400),
    ("tool_choice required without tools", json.dumps(_chat("hi", tool_choice="required")).encode(), 400),
    ("a tool call and a response format", json.dumps(_chat("hi", tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice="required", response_format={"type": "json_object"})).encode(), 400),
    # logit rules out of range
    ("logit bias too large", json.dumps(_chat("hi", logit_bias={"5": 150})).encode(), 400),
    ("logit bias on a word", json.dumps(_chat("hi", logit_bias={"hello": 1})).encode(), 400),
    ("logit bias past the vocabulary", json.dumps(_chat("hi", logit_bias={"99999": 1})).encode(), 400),
    ("frequency penalty out of range", json.dumps(_chat("hi", frequency_penalty=2.5)).encode(), 400),
    ("repetition penalty 0", json.dumps(_chat("hi", repetition_penalty=0)).encode(), 400),
    ("min_tokens above max_tokens", json.dumps(_chat("hi", max_tokens=3, min_tokens=4)).encode(), 400),
    ("stop token past the vocabulary", json.dumps(_chat("hi", stop_token_ids=[99999])).encode(), 400),
    ("JSON nested too deep", b"[" * 100_000 + b"]" * 100_000, 400),
]


def test_a_web_page_cannot_post_to_the_api(tiny_server) -> None:
    """A body a browser sends to another site without asking first (a form, text/plain) is
    refused with 415, so a page the server's user opens cannot drive a server without a key."""
    body = json.dumps(_chat("hi", max_tokens=2))
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body, timeout=30,
                          headers={**AUTH, "Content-Type": kind, "Origin": "http://elsewhere.example"})
        assert resp.status_code == 415 and "application/json" in resp.json()["error"]["message"], (kind, resp.text)
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body, timeout=60, headers=AUTH)
    assert resp.status_code == 200  # (no Content-Type at all: a script's request, read as JSON)
    # a page elsewhere may send a body no Content-Type names (a Blob): its Origin is refused
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body, timeout=60,
                      headers={**AUTH, "Origin": "http://elsewhere.example"})
    assert resp.status_code == 403 and "--allowed-origins" in resp.json()["error"]["message"]
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=body, timeout=60,
                      headers={**AUTH, "Origin": "http://app.example"})  # (allowed by the fixture's flag)
    assert resp.status_code == 200


@pytest.mark.parametrize("name,payload,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_json_error(tiny_server, name, payload, status) -> None:
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=payload,
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and "Traceback" not in resp.text


def test_an_error_names_the_field_it_is_about(tiny_server) -> None:
    """``param`` is the field at fault also where the message does not begin with it, and a
    number that is not finite is called that, not out of range."""
    for body, param, words in ((_chat("hi", logit_bias={"5": float("nan")}), "logit_bias", "logit_bias of token 5"),
                               (_chat("hi", temperature=float("nan")), "temperature", "finite"),
                               (_chat("hi", top_p=float("inf")), "top_p", "finite")):
        resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=json.dumps(body).encode(),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == param and words in error["message"], resp.text


def test_unsupported_features_are_named_and_neutral_values_pass(tiny_server) -> None:
    """A field the server cannot honour is refused with its name; the same fields at their
    neutral values (as many clients send them) are accepted."""
    neutral = _chat("hi", max_tokens=2, logprobs=False, tools=[], tool_choice="none", frequency_penalty=0,
                    response_format={"type": "text"})
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=neutral, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    for field, value in (("suffix", "end"), ("best_of", 3), ("tool_choice", "required")):
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": TINY, "prompt": "ab", "max_tokens": 2, field: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
        assert field in resp.json()["error"]["message"]


def test_logit_rules_and_stop_tokens(tiny_server) -> None:
    """logit_bias forces or bans tokens, stop_token_ids end the answer, min_tokens holds the
    end off, and the penalties change the answer the same way every time."""
    def ask(**kw) -> dict:
        body = {"model": TINY, "prompt": "abcabcab", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **kw}
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]

    free = ask()["token_ids"]
    assert ask(logit_bias={"9": 100})["token_ids"] == [9] * 12
    assert free[0] not in ask(logit_bias={str(free[0]): -100})["token_ids"]
    stop = free[3]
    cut = ask(stop_token_ids=[stop])
    assert cut["finish_reason"] == "stop" and cut["token_ids"] == free[: free.index(stop) + 1]
    # the stop token's text is left out (as vLLM does) unless include_stop_str_in_output, streamed too
    said = httpx.post(f"{tiny_server.url}/detokenize", headers=AUTH, timeout=60, json={"tokens": [stop]}).json()
    kept = ask(stop_token_ids=[stop], include_stop_str_in_output=True)["text"]
    assert said["prompt"] and kept == cut["text"] + said["prompt"]
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": TINY, "prompt": "abcabcab", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [stop], "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == cut["text"]
    held = ask(stop_token_ids=[stop], min_tokens=free.index(stop) + 2)["token_ids"]
    assert len(held) > free.index(stop) + 1 and stop not in held[: free.index(stop) + 2]
    # a stop string counts only after min_tokens tokens: in all 12 of them, it cuts nothing
    whole = ask()["text"]
    first = whole.strip()[0]
    assert ask(stop=[first])["text"] == whole[: whole.index(first)]
    kept = ask(stop=[first], min_tokens=12)
    assert kept["text"] == whole and kept["finish_reason"] == "length"
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": TINY, "prompt": "abcabcab", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [first], "min_tokens": 12, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    for bad, param in ((dict(logit_bias={"5": 150}), "logit_bias"), (dict(min_tokens=13), "min_tokens"),
                       (dict(stop_token_ids=[10**6]), "stop_token_ids"), (dict(prompt=[10**6]), "prompt")):
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": TINY, "prompt": "ab", "max_tokens": 12, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        if param == "min_tokens":  # (named as the request names the limit)
            assert "max_tokens (12)" in resp.json()["error"]["message"], resp.text
    penalised = ask(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)["token_ids"]
    assert penalised != free and ask(frequency_penalty=1.5, presence_penalty=0.5,
                                     repetition_penalty=1.3)["token_ids"] == penalised


def test_a_prediction_speeds_the_answer_and_never_changes_it(tiny_server) -> None:
    """OpenAI's Predicted Outputs: a prediction, as text or content parts, leaves the answer as
    it is (that it is drafted from is test_suffix's: here the server's store of earlier answers
    drafts the repeated request anyway); a bad one is a 400 naming it."""
    def ask(**kw) -> dict:
        body = _chat("qwe rty", max_tokens=40, temperature=0, ignore_eos=True, **kw)
        resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", headers=AUTH, timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    plain = ask()
    answer = plain["choices"][0]["message"]["content"]
    predicted = ask(prediction={"type": "content", "content": answer})
    assert predicted["choices"][0]["message"]["content"] == answer
    parts = ask(prediction={"type": "content", "content": [{"type": "text", "text": "zzzz"}]})
    assert parts["choices"][0]["message"]["content"] == answer
    for prediction in ({"type": "audio", "content": "x"}, {"type": "content", "content": "ab" * 600}):
        resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json=_chat("qwe", max_tokens=4, prediction=prediction))
        assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("prediction"), resp.text


def test_structured_output_fields(tiny_server) -> None:
    """vLLM's guided_regex and guided_choice hold the answer to their form; a bad one is a
    400 naming its field."""
    def ask(**kw) -> httpx.Response:
        body = {"model": TINY, "prompt": "abcab", "max_tokens": 40, "temperature": 1.0, "seed": 3, **kw}
        return httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json=body)

    for _ in range(2):
        text = ask(guided_regex=r"[a-c]{2,5}\d").json()["choices"][0]["text"]
        assert re.fullmatch(r"[a-c]{2,5}\d", text), text
    chosen = ask(guided_choice=["left", "right"]).json()
    assert chosen["choices"][0]["text"] in ("left", "right"), chosen
    resp = ask(guided_grammar="root ::= (")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_grammar", resp.text
    # a pattern past the grammar engine's limits: a 400 with the engine's reason, streamed or not,
    # each counted once, as a grammar end (every status's series is there from the start)
    counts = {s: tiny_server.metric(f'sot:requests_total{{status="{s}"}}') for s in ("grammar", "invalid", "error")}
    listed = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text
    assert all(f'sot:requests_total{{status="{s}"}}' in listed for s in ("stop", "abort", "grammar", "error"))
    huge = r"((b{100}){100}){90}"
    for _ in range(2):
        resp = ask(guided_regex=huge, temperature=0)
        assert resp.status_code == 400 and "grammar engine stopped" in resp.json()["error"]["message"], resp.text
    streamed = ask(guided_regex=huge, temperature=0, stream=True)
    errors = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert errors and errors[0]["error"]["type"] == "invalid_request_error" and "grammar engine" in str(errors)
    assert {s: tiny_server.metric(f'sot:requests_total{{status="{s}"}}') for s in counts} == \
        {"grammar": counts["grammar"] + 3, "invalid": counts["invalid"], "error": counts["error"]}


def test_tokenize_and_detokenize(tiny_server) -> None:
    """vLLM's routes: a prompt's tokens (chat messages with the template the chat route
    applies, so the count is the prompt's usage) and back."""
    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{tiny_server.url}{route}", headers=AUTH, timeout=60, json=body)

    got = post("/tokenize", model=TINY, prompt="abcab").json()
    assert got["count"] == len(got["tokens"]) == 5 and got["max_model_len"] == 512
    assert post("/detokenize", tokens=got["tokens"]).json() == {"prompt": "abcab"}
    messages = [{"role": "user", "content": "hello there"}]
    chat = post("/tokenize", messages=messages).json()
    used = post("/v1/chat/completions", model=TINY, messages=messages, max_tokens=1).json()["usage"]
    assert chat["count"] == used["prompt_tokens"] > 11
    for body, status, param in ((dict(), 400, "prompt"), (dict(prompt="a", messages=messages), 400, "prompt"),
                                (dict(prompt="a", model="gpt-9"), 404, "model")):
        resp = post("/tokenize", **body)
        assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text
    resp = post("/detokenize", tokens=[10**6])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"


def test_chat_template_fields(tiny_server) -> None:
    """vLLM's continue_final_message and add_generation_prompt: the prompt ends inside the
    assistant's message, and the answer continues it; both at once is a 400."""
    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{tiny_server.url}{route}", headers=AUTH, timeout=60, json={"model": TINY, **body})

    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abc"}]
    ids = post("/tokenize", messages=partial, add_generation_prompt=False, continue_final_message=True).json()
    assert post("/detokenize", tokens=ids["tokens"]).json()["prompt"].endswith("assistant: abc")
    whole = post("/v1/chat/completions", messages=partial, add_generation_prompt=False, continue_final_message=True,
                 max_tokens=4, temperature=0, return_token_ids=True).json()
    assert whole["prompt_token_ids"] == ids["tokens"] and whole["usage"]["prompt_tokens"] == ids["count"]
    resp = post("/v1/chat/completions", messages=partial, continue_final_message=True, max_tokens=4)
    assert resp.status_code == 400 and "cannot both be true" in resp.json()["error"]["message"], resp.text
    resp = post("/v1/chat/completions", messages=partial[:1], continue_final_message=True,
                add_generation_prompt=False, max_tokens=4)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text


def test_model_card_version_cors_and_request_log(tiny_server) -> None:
    """GET /v1/models/{id} (404 for another), /version, CORS for the allowed origin only, and
    one log line per finished request with its id."""
    from sot import __version__

    card = httpx.get(f"{tiny_server.url}/v1/models/{TINY}", headers=AUTH, timeout=30)
    assert card.status_code == 200 and card.json()["id"] == TINY and card.json()["max_model_len"] == 512
    assert httpx.get(f"{tiny_server.url}/v1/models/gpt-9", headers=AUTH, timeout=30).status_code == 404
    assert httpx.get(f"{tiny_server.url}/version", timeout=30).json() == {"version": __version__}
    probe = httpx.head(f"{tiny_server.url}/health", timeout=30)  # (a load balancer's probe)
    assert probe.status_code == 200 and probe.content == b""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{tiny_server.url}/v1/chat/completions", timeout=30,
                       headers={"Origin": "http://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(f"{tiny_server.url}/v1/chat/completions", timeout=30,
                          headers={"Origin": "http://elsewhere.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    rid = httpx.post(f"{tiny_server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                     json=_chat("hi", max_tokens=3, ignore_eos=True)).json()["id"]
    line = _log_line(tiny_server, rid)
    assert re.search(r"1 choice\(s\), prompt \d+ tokens \(\d+ cached\), 3 generated, tau [\d.]+, [\d.]+ s, finish "
                     r"length", line), line
    # a Responses answer's line goes under its own id
    rid = httpx.post(f"{tiny_server.url}/v1/responses", headers=AUTH, timeout=60,
                     json={"model": TINY, "input": "hi", "max_output_tokens": 3}).json()["id"]
    assert rid.startswith("resp_") and "finish length" in _log_line(tiny_server, rid)
    # so does a stream its client left: its choices end as aborted
    body = _chat("hi", max_tokens=480, ignore_eos=True, temperature=1.0, stream=True)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            rid = json.loads(next(x for x in lines if x.startswith("data: {"))[6:])["id"]
    assert "finish abort" in _log_line(tiny_server, rid)


def test_a_request_without_a_model_is_for_the_served_one(tiny_server) -> None:
    """``model`` may be left out (as vLLM allows): the answer names the served model."""
    url = tiny_server.url
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    text = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={"prompt": "abc", "max_tokens": 3})
    response = httpx.post(f"{url}/v1/responses", headers=AUTH, timeout=60, json={"input": "hi", "max_output_tokens": 3})
    for r in (chat, text, response):
        assert r.status_code == 200 and r.json()["model"] == TINY, r.text
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and all(c["model"] == TINY for c in chunks)


def _log_line(server, rid: str) -> str:
    """The server log's line for request ``rid`` (waited for: it is written as the request ends)."""
    deadline = time.monotonic() + 10
    while rid not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return next(x for x in server.log.read_text().splitlines() if rid in x)


def test_api_key_is_required(tiny_server) -> None:
    # a key with a character beyond ASCII is a wrong key too, not a 500
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": b"Bearer s\xe9krit"}):
        resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=_chat("hi", max_tokens=2), headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{tiny_server.url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200, "health needs no key"


def test_stop_strings_end_the_text_before_them(tiny_server) -> None:
    free = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": TINY, "prompt": "abcabc", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    text = free.json()["choices"][0]["text"]
    stop = text[5:7]
    cut = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                     json={"model": TINY, "prompt": "abcabc", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                           "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    # vLLM's include_stop_str_in_output keeps the stop string, whole or streamed
    ask = {"model": TINY, "prompt": "abcabc", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
           "stop": [stop], "include_stop_str_in_output": True}
    kept = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json=ask).json()["choices"][0]
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={**ask, "stream": True}) as r:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))
    assert streamed == kept["text"]
    # skip_special_tokens false shows the end-of-sequence token's text (forced here by a bias)
    shown = {skip: httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": TINY, "prompt": "abc", "max_tokens": 2, "ignore_eos": True, "logit_bias": {"2": 100},
        "skip_special_tokens": skip}).json()["choices"][0]["text"] for skip in (True, False)}
    assert shown == {True: "", False: "</s></s>"}
    # and a stop string is found in that text: the answer ends where the returned text is cut
    cut = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": TINY, "prompt": "abc", "max_tokens": 4, "ignore_eos": True, "logit_bias": {"2": 100},
        "skip_special_tokens": False, "stop": ["</s>"], "logprobs": 0}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == 1, cut
    assert cut["choices"][0]["text"] == "" and cut["choices"][0]["logprobs"]["tokens"] == [], cut


def test_stop_strings_end_token_ids_and_usage_where_plain_decoding_ends(tiny_server) -> None:
    """The tokens of an answer cut by a stop string end at the token that completes it, as
    plain decoding's do, also when that token was accepted in the middle of a drafted run;
    ``usage`` counts those tokens, and a stop completed by the last allowed token is ``stop``."""
    def ask(**kw) -> dict:
        body = {"model": TINY, "prompt": "abcabcabcabc", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **kw}
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    free = ask()["choices"][0]
    ids, text = free["token_ids"], free["text"]
    decode = {n: httpx.post(f"{tiny_server.url}/detokenize", headers=AUTH, timeout=60,  # (without </s>, as the text)
                            json={"model": TINY, "tokens": ids[:n]}).json()["prompt"].replace("</s>", "")
              for n in range(1, len(ids) + 1)}
    for at in range(2, len(text) - 6, 4):
        stop = text[at : at + 6]
        end = min(n for n in decode if stop in decode[n])  # plain decoding stops at this token
        cut = ask(stop=stop)
        assert cut["choices"][0]["token_ids"] == ids[:end] and cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["completion_tokens"] == end
        last = ask(stop=stop, max_tokens=end)["choices"][0]
        assert last["finish_reason"] == "stop" and last["token_ids"] == ids[:end]


def test_openai_request_conventions(tiny_server) -> None:
    """What OpenAI clients rely on: ``null`` for an optional field means its default, a
    completion prompt may be a list of token-id prompts, a completion's ``max_tokens``
    defaults to 16, ``stream_options`` needs a stream, and errors name the field the client
    sent (Responses fields too)."""
    url = tiny_server.url
    with httpx.Client(timeout=60, headers=AUTH) as client:
        nulls = dict(temperature=None, top_p=None, n=None, stream=None, logprobs=None, presence_penalty=None,
                     frequency_penalty=None, parallel_tool_calls=None, top_k=None, ignore_eos=None)
        resp = client.post(f"{url}/v1/chat/completions", json=_chat("abc", max_tokens=3, **nulls))
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, resp.text
        resp = client.post(f"{url}/v1/responses", json={"model": TINY, "input": "abc", "max_output_tokens": 3,
                                                         "temperature": None, "top_p": None, "stream": None})
        assert resp.status_code == 200, resp.text

        def complete(**kw) -> dict:
            resp = client.post(f"{url}/v1/completions", json={"model": TINY, "temperature": 0, **kw})
            assert resp.status_code == 200, resp.text
            return resp.json()

        alone = [complete(prompt=p, max_tokens=5)["choices"][0]["text"] for p in ([67, 68, 69], [70, 71])]
        both = complete(prompt=[[67, 68, 69], [70, 71]], max_tokens=5)["choices"]
        assert [c["text"] for c in sorted(both, key=lambda c: c["index"])] == alone
        for limit in ({}, {"max_tokens": None}):
            assert complete(prompt="abc", ignore_eos=True, **limit)["usage"]["completion_tokens"] == 16

        def error(path: str, body: dict, status: int = 400) -> dict:
            resp = client.post(f"{url}{path}", json={"model": TINY, **body})
            assert resp.status_code == status, resp.text
            return resp.json()["error"]

        assert error("/v1/chat/completions", _chat("abc", stream_options={"include_usage": True}))["param"] == \
            "stream_options"
        assert error("/v1/completions", {"prompt": "x" * 700, "max_tokens": 2})["param"] == "prompt"
        assert error("/v1/chat/completions", _chat("x" * 700, max_tokens=2))["param"] == "messages"
        zero = error("/v1/chat/completions", _chat("abc", max_completion_tokens=0))
        assert zero["param"] == "max_completion_tokens" and "max_completion_tokens" in zero["message"]
        zero = error("/v1/responses", {"input": "abc", "max_output_tokens": 0})
        assert zero["param"] == "max_output_tokens" and "max_output_tokens" in zero["message"]
        assert error("/v1/responses", {"input": "x" * 700, "max_output_tokens": 2})["param"] == "input"
        wrong_method = client.put(f"{url}/v1/chat/completions", json={})
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"
        cut = client.post(f"{url}/v1/responses", json={"model": TINY, "input": "abc", "max_output_tokens": 2,
                                                        "temperature": 0, "ignore_eos": True}).json()
        assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
        assert cut["tool_choice"] == "auto"


def _running(server) -> float:
    return server.metric("sot:num_requests_running")


def _assert_aborted_and_freed(server, aborted_before: float) -> None:
    """Within 10 s, no request holds a slot and one more was aborted."""
    deadline = time.monotonic() + 10
    while _running(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0, "the disconnected request still holds its slot"
    assert server.metric('sot:requests_total{status="abort"}') == aborted_before + 1


def test_a_disconnect_frees_the_slot(default_server) -> None:
    """(On the default model: 3,000 sampled tokens take far longer than the test waits, so
    only the abort can free the slot in time.)"""
    server = default_server
    aborted = server.metric('sot:requests_total{status="abort"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000,
            "temperature": 1.0, "seed": 1, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            # (a named iterator: a discarded one is closed on the spot, and with it the connection)
            lines = r.iter_lines()
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break  # the stream is running
            deadline = time.monotonic() + 5
            while _running(server) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _running(server) == 1
    _assert_aborted_and_freed(server, aborted)


def test_continuous_usage_stats(tiny_server) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk of a stream (two choices here) carries
    the usage so far, growing to the final usage chunk's; without it the chunks carry none."""
    body = _chat("abc abc abc", max_tokens=12, temperature=0.8, seed=2, n=2, stream=True,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})

    def chunks(payload: dict) -> list[dict]:
        with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=payload, headers=AUTH,
                          timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    got = chunks(body)
    usages = [c["usage"] for c in got]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[0] == 0
    assert not got[-1]["choices"] and usages[-1]["completion_tokens"] > 0  # the final usage chunk
    assert usages[-2]["completion_tokens"] == usages[-1]["completion_tokens"]
    assert usages[-2]["prompt_tokens"] == usages[-1]["prompt_tokens"]
    plain = chunks({**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == done[-1]


def test_responses_are_kept_and_continued(tiny_server) -> None:
    """A finished response is kept: ``previous_response_id`` continues its conversation
    (the answer equals the chat completion of the whole conversation), a streamed one is kept
    too, ``GET`` reads one back, ``DELETE`` drops it, and ``store: false`` keeps nothing."""
    url = f"{tiny_server.url}/v1/responses"
    ask = {"model": TINY, "max_output_tokens": 10, "temperature": 0, "instructions": "be brief"}
    with httpx.Client(timeout=60, headers=AUTH) as client:
        first = client.post(url, json={**ask, "input": "abc abc"}).json()
        assert first["store"] is True and first["previous_response_id"] is None
        assert client.get(f"{url}/{first['id']}").json() == first
        said = first["output"][0]["content"][0]["text"]
        second = client.post(url, json={**ask, "input": "def", "previous_response_id": first["id"]}).json()
        assert second["previous_response_id"] == first["id"]
        chat = client.post(f"{tiny_server.url}/v1/chat/completions", json={
            "model": TINY, "max_tokens": 10, "temperature": 0, "messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "abc abc"},
                {"role": "assistant", "content": said}, {"role": "user", "content": "def"}]}).json()
        assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
        assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]

        events = []
        with client.stream("POST", url, json={**ask, "input": "ghi", "stream": True,
                                              "previous_response_id": second["id"]}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        streamed = events[-1]["response"]
        assert client.get(f"{url}/{streamed['id']}").json()["output"] == streamed["output"]
        page = client.get(f"{tiny_server.url}/trace/{streamed['id']}")  # (found by the response's own id)
        assert page.status_code == 200 and 'id="trace-data"' in page.text

        listed = client.get(f"{url}/{second['id']}/input_items", params={"order": "asc"}).json()
        assert listed["object"] == "list" and not listed["has_more"]
        assert [(i["type"], i["role"], i["content"]) for i in listed["data"]] == [
            ("message", "user", [{"type": "input_text", "text": "def"}])]
        assert listed["first_id"] == listed["data"][0]["id"]
        bad = client.get(f"{url}/{second['id']}/input_items", params={"order": "sideways"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "order"

        unkept = client.post(url, json={**ask, "input": "abc", "store": False}).json()
        assert unkept["store"] is False
        missing = client.get(f"{url}/{unkept['id']}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        refused = client.post(url, json={**ask, "input": "x", "previous_response_id": unkept["id"]})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"

        assert tiny_server.metric("sot:responses_kept") >= 3 and tiny_server.metric("sot:prefix_cache_bytes") > 0
        gone = client.delete(f"{url}/{first['id']}")
        assert gone.json() == {"id": first["id"], "object": "response", "deleted": True}
        assert client.get(f"{url}/{first['id']}").status_code == 404
        broken = client.post(url, json={**ask, "input": "x", "previous_response_id": second["id"]})
        assert broken.status_code == 404 and "which was deleted" in broken.json()["error"]["message"]


def test_responses_give_log_probabilities(tiny_server) -> None:
    """``include: [message.output_text.logprobs]`` (with ``top_logprobs``) gives each answer
    token's log probability and alternatives: the chat completion's for the same request,
    whole and across a stream's deltas; other ``include`` values are refused by name."""
    url = f"{tiny_server.url}/v1/responses"
    ask = {"model": TINY, "max_output_tokens": 8, "temperature": 0, "input": "abc abc",
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    with httpx.Client(timeout=60, headers=AUTH) as client:
        whole = client.post(url, json=ask).json()
        part = whole["output"][0]["content"][0]
        assert whole["top_logprobs"] == 2 and part["logprobs"]
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in part["logprobs"])
        chat = client.post(f"{tiny_server.url}/v1/chat/completions", json={
            "model": TINY, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": "abc abc"}]}).json()
        assert part["logprobs"] == chat["choices"][0]["logprobs"]["content"]
        with client.stream("POST", url, json={**ask, "stream": True}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [x for e in deltas for x in e["logprobs"]] == part["logprobs"]
        (done,) = [e for e in events if e["type"] == "response.output_text.done"]
        assert done["logprobs"] == part["logprobs"]
        alone = client.post(url, json={k: v for k, v in ask.items() if k != "include"}).json()  # top_logprobs asks too
        assert alone["output"][0]["content"][0]["logprobs"] == part["logprobs"]
        plain = client.post(url, json={k: v for k, v in ask.items() if k not in ("include", "top_logprobs")}).json()
        assert plain["output"][0]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 0
        bad = client.post(url, json={**ask, "include": ["reasoning.encrypted_content"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "include"


def test_a_responses_stream_closed_early_frees_the_slot(default_server) -> None:
    """The Responses stream is a translation of a chat stream: a client that hangs up on it
    aborts the request as a chat client's would."""
    server = default_server
    aborted = server.metric('sot:requests_total{status="abort"}')
    body = {"model": MODEL, "input": "Tell a long story.", "max_output_tokens": 3000, "temperature": 1.0,
            "seed": 1, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/responses", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if "response.output_text.delta" in line:
                    break
            assert _running(server) == 1
    _assert_aborted_and_freed(server, aborted)


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_slots(default_server) -> None:
    """Without a stream, tokens keep coming while the client waits, and the server must still
    notice that it left: both choices of an ``n = 2`` request are aborted."""
    server = default_server
    aborted = server.metric('sot:requests_total{status="abort"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000,
            "temperature": 1.0, "seed": 1, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=2.0)
    deadline = time.monotonic() + 15  # (a busy machine: the server notices the client left within a poll or two)
    while (_running(server) != 0 or server.metric('sot:requests_total{status="abort"}') < aborted + 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0, "the requests of a client that left still hold their slots"
    assert server.metric('sot:requests_total{status="abort"}') == aborted + 2


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", json=body, headers=AUTH)


def test_a_burst_beyond_the_queue_gets_429_and_the_rest_complete(tiny_dir, tmp_path) -> None:
    server = ServerProcess("--model", str(tiny_dir), "--served-model-name", TINY, "--max-batch", "2",
                           "--max-queue", "2", "--api-key", "sekrit", log=tmp_path / "burst.log")
    try:
        server.wait_ready()

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(_post(client, server.url, _chat(f"burst {i}", max_tokens=60,
                                                                           ignore_eos=True, temperature=0))
                                              for i in range(12)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and set(codes) <= {200, 429}
        assert codes.count(200) >= 4, "the batch and the queue were served"
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 60
    finally:
        server.stop()


def test_bounded_soak_loses_no_request(tiny_server) -> None:
    """300 requests at concurrency 8, about 10% bad, 10% disconnecting and 15% through the
    Responses API: every accepted request gets its whole answer or its own error, /health
    stays 200, RSS grows < 100 MB."""
    rng = random.Random(11)
    plan = []
    for i in range(300):
        kind = rng.choices(["good", "bad", "leave", "responses"], [7, 1, 1, 1.5])[0]
        plan.append((kind, rng.randint(2, 24), rng.random() < 0.5))
    proc = psutil.Process(tiny_server.proc.pid)
    rss_start = proc.memory_info().rss
    outcomes: list[str] = []
    health: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        kind, n, stream = plan[i]
        body = _chat(f"request {i}: " + "abc" * (i % 7), max_tokens=n, temperature=0.7 * (i % 2), ignore_eos=True,
                     stream=stream or kind == "leave")
        if kind == "bad":
            body["max_tokens"] = -n
            r = await _post(client, tiny_server.url, body)
            outcomes.append("bad-ok" if r.status_code == 400 and "error" in r.json() else f"bad-{r.status_code}")
            return
        if kind == "responses":
            asked = {"model": TINY, "input": body["messages"][0]["content"], "max_output_tokens": n,
                     "temperature": body["temperature"], "ignore_eos": True, "stream": stream}
            if not stream:
                r = await client.post(f"{tiny_server.url}/v1/responses", json=asked, headers=AUTH)
                done = r.status_code == 200 and r.json()["usage"]["output_tokens"] == n
                outcomes.append("ok" if done else f"lost-responses-{r.status_code}")
                return
            last = None
            async with client.stream("POST", f"{tiny_server.url}/v1/responses", json=asked, headers=AUTH) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[len("data: "):])
            done = last is not None and last["type"] == "response.incomplete" and \
                last["response"]["usage"]["output_tokens"] == n
            outcomes.append("ok" if done else "lost-responses-stream")
            return
        if kind == "leave":
            async with client.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
                async for _ in r.aiter_lines():
                    break
            outcomes.append("left")
            return
        if not stream:
            r = await _post(client, tiny_server.url, body)
            done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
            outcomes.append("ok" if done else f"lost-{r.status_code}")
            return
        chunks, finished = 0, False
        async with client.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    finished = True
                elif line.startswith("data: {"):
                    chunks += 1
        outcomes.append("ok" if finished and chunks >= 2 else "lost-stream")

    async def main() -> None:
        queue = list(range(len(plan)))
        async with httpx.AsyncClient(timeout=120) as client:
            async def user() -> None:
                while queue:
                    await one(client, queue.pop(0))

            async def watch() -> None:
                while queue:
                    health.append((await client.get(f"{tiny_server.url}/health")).status_code)
                    await asyncio.sleep(0.25)

            await asyncio.wait_for(asyncio.gather(watch(), *(user() for _ in range(8))), timeout=400)

    asyncio.run(main())
    assert len(outcomes) == 300
    lost = [o for o in outcomes if o not in ("ok", "bad-ok", "left")]
    assert not lost, f"lost or wrong: {lost[:10]}"
    assert health and set(health) == {200}
    deadline = time.monotonic() + 10
    while _running(tiny_server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(tiny_server) == 0
    growth = (proc.memory_info().rss - rss_start) / 2**20
    assert growth < 100, f"RSS grew by {growth:.0f} MB"


def test_sigterm_while_the_model_loads_exits_0(tiny_dir, tmp_path) -> None:
    """Stopped while its model is still loading (/health answers 503), the server exits 0 with a
    line that says so, not with an abort from the loading thread's compiled code."""
    server = ServerProcess("--model", str(tiny_dir), "--served-model-name", TINY, log=tmp_path / "early.log")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 503:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail("the server never answered 503 while loading")
        assert server.stop() == 0
        log = server.log.read_text()
        assert "terminate called" not in log and "Aborted" not in log
        assert "ready on" in log or "stopped before the model had loaded" in log
    finally:
        server.stop()


def test_sigterm_finishes_streams_and_exits_0(tiny_dir, tmp_path) -> None:
    server = ServerProcess("--model", str(tiny_dir), "--served-model-name", TINY, "--shutdown-timeout", "1",
                           log=tmp_path / "term.log")
    try:
        server.wait_ready()
        lines = []
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{server.url}/v1/chat/completions",
                               json=_chat("go on", max_tokens=450, ignore_eos=True, temperature=0, stream=True)) as r:
                it = r.iter_lines()
                lines.append(next(it))
                server.proc.terminate()
                lines.extend(it)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" or (lines[-2:] and "data: [DONE]" in lines[-2:])
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "abort")
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_a_client_gone_while_sending_is_no_server_error(tiny_server) -> None:
    """A client that hangs up before its request's body arrives is counted as aborted, not as
    a server error."""
    errors, aborted = (tiny_server.metric(f'sot:requests_total{{status="{s}"}}') for s in ("error", "abort"))
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sekrit\r\nContent-Length: 400\r\n\r\n{\"model\": ")
    deadline = time.monotonic() + 10
    while tiny_server.metric('sot:requests_total{status="abort"}') == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tiny_server.metric('sot:requests_total{status="abort"}') == aborted + 1
    assert tiny_server.metric('sot:requests_total{status="error"}') == errors


def test_serve_stops_at_once_when_it_cannot_serve(tiny_dir, tmp_path) -> None:
    """A model, or a store file, that fails to load ends the server with the error naming it
    (it does not answer 503 until someone notices); a port already taken is a one-line error
    before anything says the server listens."""
    cmd = [sys.executable, "-m", "sot.cli", "serve", "--host", "127.0.0.1"]
    res = subprocess.run([*cmd, "--port", str(free_port()), "--model", str(tmp_path / "no-such-model")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "failed to load" in res.stderr and "no-such-model" in res.stderr and "Traceback" not in res.stderr
    store = tmp_path / "answers.store"
    store.write_bytes(b"not a store")
    res = subprocess.run([*cmd, "--port", str(free_port()), "--model", str(tiny_dir), "--drafter", "suffix",
                          "--suffix-store", str(store)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    line = next(x for x in res.stderr.splitlines() if "failed to load" in x)
    assert f"{store} is not a suffix store written by SoT" in line and "the model failed" not in line, line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = subprocess.run([*cmd, "--port", str(taken.getsockname()[1])], capture_output=True, text=True,
                             timeout=120)
    assert res.returncode == 2 and "cannot listen on 127.0.0.1" in res.stderr and "another --port" in res.stderr
    assert "listening" not in res.stderr and "Traceback" not in res.stderr


def test_suffix_stores_per_user_live_with_the_server(tiny_dir, tmp_path) -> None:
    """``--suffix-tenants user``: each request's answer goes to its ``user``'s store, shared by
    that user's later requests (the repeated question drafts its earlier answer) and never
    another's; ``--suffix-store`` is written on shutdown."""
    from sot.drafters import SuffixStores
    from sot.server.app import tenant_key

    store = tmp_path / "answers.store"
    # (no fallback: the tiny model's noisy step times must not make a sequence decode plainly)
    server = ServerProcess("--model", str(tiny_dir), "--served-model-name", TINY, "--drafter", "suffix",
                           "--suffix-tenants", "user", "--suffix-store", str(store), "--fallback-threshold", "0",
                           log=tmp_path / "suffix.log")
    try:
        server.wait_ready()
        body = _chat("list: a b c d", max_tokens=40, ignore_eos=True, temperature=0)
        steps = []
        for user in ("alice", "alice", "bob"):
            resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "user": user}, timeout=60)
            assert resp.status_code == 200
            steps.append(resp.json()["sot"]["steps"])
        assert steps[1] < steps[0] // 2, "alice's repeated question drafts her earlier answer"
        assert steps[2] > steps[1] * 2, "bob's does not draft from alice's answers"
        assert server.stop() == 0
        stores = SuffixStores(per_tenant=True)
        stores.load(store)
        # (kept under a digest of each user: the file holds no user names)
        assert stores.get(tenant_key("alice")).sequences == 2 and stores.get(tenant_key("bob")).sequences == 1
        assert set(stores.stores) == {tenant_key("alice"), tenant_key("bob")}
    finally:
        server.stop()


def test_trace_pages_of_finished_requests(tiny_server, default_server) -> None:
    """With --trace N the last N finished requests are served as trace pages; older ones,
    unknown ids and a server without --trace answer a JSON 404."""
    ids = []
    for prompt in ("abcabc", "xyzxyz", "hello hello"):
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": TINY, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True})
        ids.append(resp.json()["id"])
    # the page holds the prompt and the answer, so it needs the key as the API does
    assert httpx.get(f"{tiny_server.url}/trace/{ids[-1]}", timeout=60).status_code == 401
    page = httpx.get(f"{tiny_server.url}/trace/{ids[-1]}", headers=AUTH, timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-store" and page.headers["x-content-type-options"] == "nosniff"
    assert 'id="trace-data"' in page.text and ids[-1] in page.text
    # what ran, as the CLI's pages say
    assert re.search(rf"drafter \w+, (float32|bfloat16|int8), request {ids[-1]}</title>", page.text)
    # every answer of a request is traced: each prompt's, streamed or not
    for stream in (False, True):
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": TINY, "prompt": ["abcabc", "xyz"], "max_tokens": 6, "temperature": 0,
                                "ignore_eos": True, "stream": stream})
        rid = (json.loads(resp.text.split("data: ")[1]) if stream else resp.json())["id"]
        page = httpx.get(f"{tiny_server.url}/trace/{rid}", headers=AUTH, timeout=60).text
        data = json.loads(page.split('id="trace-data">', 1)[1].split("</script>", 1)[0])
        assert [s["index"] for s in data["sequences"]] == [0, 1]
        assert [len(s["pieces"]) for s in data["sequences"]] == [6, 6]
    for missing in (ids[0], "cmpl-nope"):
        gone = httpx.get(f"{tiny_server.url}/trace/{missing}", headers=AUTH, timeout=30)
        assert gone.status_code == 404 and "only the last 2" in gone.json()["error"]["message"]
    off = httpx.get(f"{default_server.url}/trace/{ids[-1]}", timeout=30)
    assert off.status_code == 404 and "--trace" in off.json()["error"]["message"]


def test_a_client_gone_before_the_stream_starts_is_aborted(default_server) -> None:
    """A client that sends a streaming request and hangs up at once (before the first byte of
    the answer) still has its request aborted and its slot freed; nothing is left in flight."""
    import socket

    server = default_server
    aborted = server.metric('sot:requests_total{status="abort"}')
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                       "max_tokens": 3000, "temperature": 1.0, "seed": 2, "ignore_eos": True, "stream": True})
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    deadline = time.monotonic() + 15
    while (server.metric('sot:requests_total{status="abort"}') != aborted + 1 or _running(server) != 0) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric('sot:requests_total{status="abort"}') == aborted + 1, "the request was not aborted"
    assert _running(server) == 0
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert ok.status_code == 200


def test_a_cache_salt_keeps_the_prefix_cache_apart(tiny_server) -> None:
    """vLLM's ``cache_salt``: a request reuses cached prompt tokens only from requests of its
    salt, so ``cached_tokens`` tells a client nothing of prompts sent under another salt."""
    prompt = "abcabcabc " * 12

    def cached(**kw) -> int:
        resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": TINY, "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="alice")
    assert cached(cache_salt="mallory") == 0 and cached(cache_salt="alice") > 100
    bad = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                     json={"model": TINY, "prompt": "a", "max_tokens": 1, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_request_latency_and_queue_time_are_measured(tiny_server) -> None:
    """vLLM's two request histograms: each finished sequence adds its time from submission to
    its last token, and its wait for a slot, which is the smaller."""
    names = ("sot:e2e_request_latency_seconds", "sot:request_queue_time_seconds")
    before = {n: (tiny_server.metric(n + "_count"), tiny_server.metric(n + "_sum")) for n in names}
    resp = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": TINY, "prompt": "abcab", "max_tokens": 4, "n": 2, "temperature": 0})
    assert resp.status_code == 200
    after = {n: (tiny_server.metric(n + "_count"), tiny_server.metric(n + "_sum")) for n in names}
    assert all(after[n][0] == before[n][0] + 2 for n in names)
    e2e, queued = (after[n][1] - before[n][1] for n in names)
    assert 0 <= queued <= e2e and e2e > 0
