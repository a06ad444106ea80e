"""``AsyncSoT``: requests from many coroutines decode as one batch, each answer equal to the
one ``SoT.generate`` gives alone; streams end before stop strings; leaving a stream early
frees its slot; a closed engine refuses requests."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from helpers import tiny_model_dir
from sot import SoT
from sot.aio import AsyncSoT
from sot.errors import ConfigError, PromptTooLongError, SoTError

PROMPTS = ["abcabcabc", "hello hello", "xyzxyz", "the cat the cat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("aio") / "model")


def test_concurrent_requests_equal_each_alone(model_dir: Path) -> None:
    alone = SoT.load(str(model_dir), drafter="none", dtype="float32")
    want = [c.token_ids for c in alone.generate(PROMPTS, chat=False, max_new_tokens=20, ignore_eos=True)]

    async def run() -> tuple[list, str, str]:
        async with AsyncSoT(SoT.load(str(model_dir), drafter="pld", dtype="float32"), max_batch=2) as engine:
            answers = await asyncio.gather(*(engine.generate(p, chat=False, max_new_tokens=20, ignore_eos=True)
                                             for p in PROMPTS))
            whole = answers[0].text
            stop = whole[5:7]
            pieces = [e async for e in engine.stream(PROMPTS[0], chat=False, max_new_tokens=20, ignore_eos=True,
                                                     stop=[stop])]
            assert pieces[-1].finished and not any(e.finished for e in pieces[:-1])
            return answers, whole, stop, "".join(e.text for e in pieces)

    answers, whole, stop, streamed = asyncio.run(run())
    assert [a.token_ids for a in answers] == want
    assert all(a.finish_reason == "length" for a in answers)
    assert streamed == whole[: whole.index(stop)]


def test_leaving_a_stream_frees_its_slot_and_a_closed_engine_refuses(model_dir: Path) -> None:
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")

    async def run() -> None:
        engine = AsyncSoT(sot, max_batch=1)
        async for event in engine.stream("abc", chat=False, max_new_tokens=400, ignore_eos=True):
            if event.text:
                break
        deadline = time.monotonic() + 10
        while sot.engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not sot.engine.has_unfinished(), "the abandoned request still runs"
        second = await engine.generate("abc", chat=False, max_new_tokens=3, ignore_eos=True)
        assert len(second.token_ids) == 3
        engine.close()
        with pytest.raises(SoTError, match="closed"):
            await engine.generate("abc", chat=False, max_new_tokens=3)

    asyncio.run(run())


def test_requests_in_flight_when_the_engine_closes_end_with_an_error(model_dir: Path) -> None:
    """A request still running and one submitted just before ``close`` both end with an
    error (none waits for ever); the engine is idle afterwards."""
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")

    async def run() -> list:
        engine = AsyncSoT(sot, max_batch=1)
        started = asyncio.Event()

        async def read_all() -> None:  # (a request known to be running: it has handed over text)
            async for event in engine.stream("abc", chat=False, max_new_tokens=400, ignore_eos=True):
                if event.text:
                    started.set()

        running = asyncio.create_task(read_all())
        await asyncio.wait_for(started.wait(), timeout=20)
        queued = asyncio.create_task(engine.generate("abd", chat=False, max_new_tokens=4))
        await asyncio.sleep(0)  # (submitted: its command waits in the worker's queue)
        engine.close()
        return await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), timeout=20)

    limit = sot.engine.max_batch
    outcomes = asyncio.run(run())
    assert all(isinstance(o, SoTError) and "shutting down" in str(o) for o in outcomes), outcomes
    assert not sot.engine.has_unfinished()
    assert sot.engine.max_batch == limit, "the engine's batch limit is given back"



def test_a_bad_request_fails_alone_and_one_engine_has_one_front(model_dir: Path) -> None:
    """A request with a setting of the wrong type is refused before it joins the batch, so a
    request running beside it finishes as if alone; a second AsyncSoT on the same SoT is
    refused (two threads must not step one engine); a stream hands over every token, also
    those whose text a stop string holds back."""
    sot = SoT.load(str(model_dir), drafter="pld", dtype="float32")
    want = sot.generate(PROMPTS[0], chat=False, max_new_tokens=30, ignore_eos=True)[0].token_ids

    async def run() -> None:
        async with AsyncSoT(sot, max_batch=2) as engine:
            with pytest.raises(ConfigError):
                AsyncSoT(sot)
            good = asyncio.create_task(engine.generate(PROMPTS[0], chat=False, max_new_tokens=30, ignore_eos=True))
            for bad in ({"logprobs": True}, {"stop": [1]}, {"temperature": float("nan")}, {"priority": "high"},
                        {"tenant": 5}):
                with pytest.raises(ConfigError):
                    await engine.generate(PROMPTS[1], chat=False, max_new_tokens=30, **bad)
            with pytest.raises(PromptTooLongError):  # (the engine's own error, not a worker's message)
                await engine.generate(PROMPTS[1], chat=False, max_new_tokens=10**6)
            with pytest.raises(ConfigError, match="an AsyncSoT runs"):  # the thread steps the engine
                sot.generate(PROMPTS[1], chat=False, max_new_tokens=3)
            assert (await good).token_ids == want
            held = sot.tokenizer.decode(want)[:3] + "\u2603"  # begins like the answer, never completes
            events = [e async for e in engine.stream(PROMPTS[0], chat=False, max_new_tokens=30, ignore_eos=True,
                                                     stop=[held])]
            assert [t for e in events for t in e.token_ids] == want
        again = AsyncSoT(sot)  # the first one closed: a new front may start
        await again.aclose()
        under_way = sot.stream(PROMPTS[0], chat=False, max_new_tokens=30, ignore_eos=True)
        first = next(under_way)  # a stream being read: its requests are not the thread's to finish
        with pytest.raises(ConfigError, match="unfinished requests"):
            AsyncSoT(sot)
        assert first.token_ids + [t for e in under_way for t in e.token_ids] == want

    asyncio.run(run())


def test_a_command_that_fails_in_the_engine_thread_fails_its_requests_not_the_thread(model_dir: Path,
                                                                                     monkeypatch) -> None:
    """Work the engine thread does between steps (an abort, when a caller leaves) that raises
    ends the requests in flight with an error instead of killing the thread, whose callers
    would then wait for ever; the next request is served."""
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32")
    real, calls = sot.engine.abort, []

    def broken(request_id: int) -> bool:
        calls.append(request_id)
        if len(calls) == 1:
            raise RuntimeError("planted")
        return real(request_id)

    monkeypatch.setattr(sot.engine, "abort", broken)

    async def run() -> tuple[object, int]:
        async with AsyncSoT(sot, max_batch=2) as engine:
            other = asyncio.create_task(engine.generate("abc", chat=False, max_new_tokens=400, ignore_eos=True))
            async for event in engine.stream("abd", chat=False, max_new_tokens=400, ignore_eos=True):
                if event.token_ids:
                    break  # leaving aborts it: the planted failure
            outcome = await asyncio.wait_for(asyncio.gather(other, return_exceptions=True), timeout=30)
            after = await asyncio.wait_for(engine.generate("abc", chat=False, max_new_tokens=3, ignore_eos=True),
                                           timeout=30)
            return outcome[0], len(after.token_ids)

    outcome, served = asyncio.run(run())
    assert isinstance(outcome, SoTError) and "planted" in str(outcome), outcome
    assert served == 3


def test_threads_sharing_one_sot_take_turns(model_dir: Path) -> None:
    """Calls from several threads on one SoT run one after another, each answer the one it
    gets alone (the engine is never stepped by two threads); a second call from a thread whose
    stream is open is refused; a stream's arguments are checked when it is asked for."""
    import sys
    import threading

    sot = SoT.load(str(model_dir), drafter="pld", dtype="float32")
    want = [sot.generate(p, chat=False, max_new_tokens=12, ignore_eos=True)[0].token_ids for p in PROMPTS]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = sot.generate(PROMPTS[i], chat=False, max_new_tokens=12, ignore_eos=True)[0].token_ids
                assert got[i] == want[i]
        except BaseException as e:  # (reported below, with the thread's own message)
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to meet any race
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert [got[i] for i in range(len(PROMPTS))] == want
    under_way = sot.stream(PROMPTS[0], chat=False, max_new_tokens=12, ignore_eos=True)
    next(under_way)
    with pytest.raises(ConfigError, match="unfinished requests"):
        sot.generate(PROMPTS[1], chat=False, max_new_tokens=3)
    under_way.close()
    assert sot.generate(PROMPTS[1], chat=False, max_new_tokens=12, ignore_eos=True)[0].token_ids == want[1]
    with pytest.raises(ConfigError, match="temperature"):
        sot.stream(PROMPTS[0], chat=False, temperature=-1)  # (not only once it is read)
    with pytest.raises(ConfigError, match="prediction must be the expected answer's text or a list"):
        sot.generate(PROMPTS[0], chat=False, prediction=5)
    drafter = sot.engine.drafter  # a call that fails as it starts leaves the engine free for the next
    drafter.reset = lambda n: (_ for _ in ()).throw(RuntimeError("broken drafter"))
    with pytest.raises(RuntimeError, match="broken drafter"):
        sot.generate(PROMPTS[1], chat=False, max_new_tokens=3)
    del drafter.reset
    assert sot.generate(PROMPTS[1], chat=False, max_new_tokens=12, ignore_eos=True)[0].token_ids == want[1]


def test_loading_options_that_cannot_work_fail_before_the_model_loads(monkeypatch) -> None:
    """A KV cache dtype that does not exist and a chat template that is not one are named
    before any weights are read."""
    import sot.api

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(sot.api, "load_model", no_load)
    monkeypatch.setattr(sot.api, "resolve_dtype_choice", no_load)
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'int4'"):
        SoT.load("/no/such/model", kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="no such file, and not a Jinja template"):
        SoT.load("/no/such/model", chat_template="no-such-template")
