"""``sot bench-serve`` against small stand-in servers: what it counts, what it reports when
requests fail, and the checks on its flags (no model is loaded)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_helpers import free_port

from sot.cli import main
from sot.server.bench import _percentiles


#: by stand-in mode, the last message of every chat request it was sent, in order
SEEN: dict[str, list[str]] = {}


def _stand_in(mode: str) -> FastAPI:
    """A server that streams five one-token chunks; ``mode`` ``usage`` ends with a usage chunk,
    ``no-usage`` leaves it out, ``slow`` sends a chunk every 0.4 s, ``key`` wants 'Bearer k2',
    ``abort`` ends the answer with finish_reason abort (as a server shutting down does),
    ``html`` answers its model list with a web page."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models(request: Request):
        if mode == "key" and request.headers.get("authorization") != "Bearer k2":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if mode == "html":
            from fastapi.responses import HTMLResponse

            return HTMLResponse("<html>not an API</html>")
        return JSONResponse({"data": [{"id": "stand-in"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if mode == "key" and request.headers.get("authorization") != "Bearer k2":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        SEEN.setdefault(mode, []).append((await request.json())["messages"][-1]["content"])

        async def events():
            import asyncio

            for i in range(5):
                if mode == "slow":
                    await asyncio.sleep(0.4)
                yield f"data: {json.dumps({'choices': [{'delta': {'content': f't{i}'}}]})}\n\n"
            if mode == "abort":
                yield f"data: {json.dumps({'choices': [{'delta': {}, 'finish_reason': 'abort'}]})}\n\n"
            if mode != "no-usage":
                yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 5}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stand_ins():
    """{mode: base URL} of one running stand-in per mode, on 127.0.0.1."""
    servers, urls = [], {}
    for mode in ("usage", "no-usage", "slow", "key", "abort", "html"):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_stand_in(mode), host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        urls[mode] = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not all(s.started for s in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield urls
    for server in servers:
        server.should_exit = True


def _bench(*args: str) -> list[str]:
    return ["bench-serve", "--prompts", "sharegpt-heldout", "--num-prompts", "2", "--concurrency", "2",
            "--max-tokens", "5", *args]


def test_percentiles_interpolate_between_samples() -> None:
    assert _percentiles([1.0, 2.0])["p50"] == 1.5
    assert _percentiles([1.0, 2.0, 3.0, 4.0]) == {"p50": 2.5, "p90": 3.7, "p99": 3.97}
    assert _percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_a_good_run_counts_usage_tokens_and_writes_its_files(stand_ins, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(_bench("--url", stand_ins["usage"], "--out", str(out))) == 0
    table = capsys.readouterr().out
    assert "| 2/2 |" in table
    result = json.loads((out / "results.json").read_text())["results"][0]
    assert result["ok"] == 2 and result["tokens"] == 10 and result["throughput_tok_s"] > 0
    assert (out / "bench-serve.png").stat().st_size > 0


def test_failed_requests_are_reported_with_their_reasons_and_exit_1(stand_ins, capsys) -> None:
    """A stream without usage and a request past --timeout are failures the run names; their
    figures stay out of the table, whose empty cells read '-'."""
    assert main(_bench("--url", stand_ins["no-usage"])) == 1
    captured = capsys.readouterr()
    assert "2 of 2 requests failed" in captured.err and "carried no usage" in captured.err
    assert "| 0/2 |" in captured.out and "None" not in captured.out
    t0 = time.monotonic()
    assert main(_bench("--url", stand_ins["slow"], "--timeout", "1")) == 1
    assert time.monotonic() - t0 < 10, "--timeout bounds the whole request, not each read"
    assert "timed out after 1 s" in capsys.readouterr().err
    assert main(_bench("--url", stand_ins["abort"])) == 1  # answers cut off by the server are no results
    assert "the server ended the answer (abort) after 5 tokens" in capsys.readouterr().err


def test_one_key_per_server(stand_ins, capsys) -> None:
    urls = ["--url", stand_ins["usage"], "--url", stand_ins["key"]]
    assert main(_bench(*urls, "--api-key", "k1", "--api-key", "k2")) == 0
    assert main(_bench(*urls, "--api-key", "k2")) == 0, "one key serves every server"
    assert main(_bench(*urls, "--api-key", "a", "--api-key", "b", "--api-key", "c")) == 2
    assert "one --api-key per --url" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "0"], "must be > 0"),
    (["--request-rate", "-1"], "must be > 0"),
    (["--timeout", "0"], "must be > 0"),
])
def test_bad_flags_are_refused_before_any_request(stand_ins, capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(_bench("--url", stand_ins["usage"], *flags))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_infinite_rate_sends_everything_at_once(stand_ins) -> None:
    """``--request-rate inf``, as vLLM's benchmarks spell it, is no error."""
    assert main(_bench("--url", stand_ins["usage"], "--request-rate", "inf")) == 0


def test_an_out_folder_that_cannot_be_made_fails_first(stand_ins, tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(_bench("--url", stand_ins["slow"], "--out", str(blocker / "run"))) == 2
    assert "cannot make the folder" in capsys.readouterr().err


def test_each_level_and_round_sends_prompts_of_its_own_after_one_warm_up(stand_ins, capsys) -> None:
    """A server that keeps earlier answers would answer a repeated prompt from memory: every
    level and round gets prompts no other run had (while the set lasts), the same on every
    server, after one untimed request per server."""
    SEEN.clear()
    urls = ["--url", stand_ins["usage"], "--url", stand_ins["no-usage"]]
    main(_bench(*urls, "--concurrency", "1,2", "--rounds", "2"))
    capsys.readouterr()
    sent = SEEN["usage"]
    assert len(sent) == 1 + 2 * 2 * 2 and sent[0] == "Say hello."
    assert len(set(sent[1:])) == 8 and sorted(sent) == sorted(SEEN["no-usage"])
    main(_bench("--url", stand_ins["usage"], "--num-prompts", "100", "--concurrency", "1,2"))
    assert "prompts repeat" in capsys.readouterr().err
    assert main(_bench("--url", stand_ins["usage"], "--concurrency", "2,2")) == 2
    assert "names a level twice" in capsys.readouterr().err
    assert main(_bench("--url", stand_ins["html"])) == 2
    assert "did not answer with a list of models" in capsys.readouterr().err
