"""``sot serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(OpenAI's Responses API, as a chat completion; ``GET`` and ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items`` for kept ones), ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /tokenize`` and ``/detokenize``, ``GET /trace/{id}`` (a
request's trace page, with ``--trace``), ``GET /version``, ``GET /health`` (503 while the model loads or the
server drains, 200 when ready) and ``GET /metrics`` (Prometheus text). Every error is an
OpenAI-style JSON body with its status; a full queue answers 429 with ``Retry-After``. A
client that disconnects aborts its request. On SIGTERM the server stops accepting connections
(requests on connections already open get 503), lets running ones finish for
``shutdown_timeout`` seconds, ends the rest with a final ``abort`` event, and exits 0.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sot import __version__
from sot.engine import GenerationParams, SequenceResult
from sot.errors import ConfigError, SoTError
from sot.requests import check_params
from sot.sampling import SamplingMode, SamplingParams
from sot.server.config import ServerConfig
from sot.server.metrics import ServerMetrics
from sot.server.protocol import (
    FINISH_REASONS, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    LogprobWriter, TextAssembler, TokenizeRequest, ToolAnswer, _GenerationRequest, checked_tools,
    prompt_logprobs_block, sot_figures, sse, usage_of, validation_message,
)
from sot.server.responses import ResponseBuilder, ResponsesRequest, ResponseStore, responses_error, sse_event
from sot.server.worker import EngineWorker, Update
from sot.tools import ToolUse

#: the routes whose requests generate (counted in ``sot:requests_total``)
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})

#: one line per finished request with ``ServerConfig.log_requests``
LOG = logging.getLogger("sot.serve")


class ServerState:
    """What the routes share: the loaded model, the worker, the request count, the phase."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.sot = None  # sot.api.SoT once loaded
        self.worker: EngineWorker | None = None
        self.model_name = config.model_name
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())
        #: response id -> each answer's (prompt, result), of the last ``config.trace`` finished requests
        self.traces: collections.OrderedDict[str, list[tuple[list[int], SequenceResult]]] = collections.OrderedDict()
        #: finished /v1/responses answers kept for previous_response_id (None: none kept)
        self.responses = ResponseStore(config.responses_kept) if config.responses_kept > 0 else None

    def keep_trace(self, rid: str, answers: list[tuple[list[int], SequenceResult | None]]) -> None:
        """Remember a finished request's steps for ``/trace/{rid}``: each answer's prompt and
        result, in the order of its choices (the oldest request goes first)."""
        kept = [(prompt, result) for prompt, result in answers if result is not None]
        if self.config.trace <= 0 or not kept:
            return
        self.traces[rid] = kept
        while len(self.traces) > self.config.trace:
            self.traces.popitem(last=False)

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.worker.alive and not self.draining

    @property
    def context(self) -> int | None:
        return self.sot.target.max_positions if self.sot is not None else None


def tenant_key(user: str | None) -> str | None:
    """The tenant a request's ``user`` stands for: a digest of it, so a client's choice of a
    long ``user`` cannot grow the per-tenant stores, and a saved store holds no user names."""
    # (no user and an empty one are one tenant, as the suffix stores count them)
    return None if not user else hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def create_app(load: Callable[[], Any], config: ServerConfig,
               on_loaded: Callable[[str | None], None] | None = None) -> FastAPI:
    """The app; ``load()`` returns a :class:`sot.api.SoT` and runs on a thread after start-up,
    so ``/health`` answers 503 while it works. ``on_loaded`` is called from that thread once it
    ends: with ``None`` when the engine serves, or with the error when loading failed (the
    CLI prints it and stops the server)."""
    metrics = ServerMetrics()
    state = ServerState(config, metrics)

    def stores() -> Any:
        return state.sot.suffix_stores if state.sot is not None else None

    def prefix_bytes() -> float:
        cache = state.sot.engine.prefix_cache if state.sot is not None else None
        return float(cache.nbytes) if cache is not None else 0.0

    metrics.watch(prefix_bytes=prefix_bytes,
                  suffix_tokens=lambda: float(stores().tokens) if stores() is not None else 0.0,
                  suffix_stores=lambda: float(len(stores().stores)) if stores() is not None else 0.0,
                  responses=lambda: float(len(state.responses)) if state.responses is not None else 0.0)

    def load_in_background() -> None:
        try:
            sot = load()
            sot.engine.max_batch = config.max_batch
            sot.engine.prompt_budget = config.prompt_budget or None
            sot.engine.record_steps = config.trace > 0
            _ = sot.engine.policy  # measure the verify cost model before serving
            state.sot = sot
            state.model_name = config.model_name or sot.name
            worker = EngineWorker(sot.engine, metrics)
            worker.start()
            state.worker = worker
        except Exception as exc:  # noqa: BLE001 - /health reports it
            # (what a user can fix, the model path or a store file, says so itself)
            state.load_error = str(exc) if isinstance(exc, SoTError) else f"{type(exc).__name__}: {exc}"
        if on_loaded is not None:
            on_loaded(state.load_error)

    async def lifespan(app: FastAPI):
        threading.Thread(target=load_in_background, name="sot-load", daemon=True).start()
        try:
            yield
        except asyncio.CancelledError:  # (a forced exit cancels the shutdown: the CLI stops the worker)
            pass
        if state.worker is not None:
            state.worker.stop()

    app = FastAPI(title="SoT", version=__version__, lifespan=lifespan)
    app.state.sot_state = state
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.counted:  # (the engine ended it: already in the metrics)
            pass
        elif exc.status in (400, 401, 404, 413, 415) and request.method == "POST" and \
                request.url.path in GENERATION_ROUTES:
            metrics.finished("invalid")  # (a stored response looked up in vain is no generation request)
        elif exc.status == 499:  # (the client hung up while sending its request)
            metrics.finished("abort")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def invalid(request: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        if request.method == "POST" and request.url.path in GENERATION_ROUTES:
            metrics.finished("invalid")
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        metrics.finished("error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    # ------------------------------------------------------------ plain routes
    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: a probe that reads the status alone)
    async def health() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "error", "detail": state.load_error}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "sot",
                "max_model_len": state.context}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_key(request, config)
        _check_ready(state)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def one_model(request: Request, model: str) -> JSONResponse:
        _check_key(request, config)
        _check_ready(state)
        _check_model(state, model)
        return JSONResponse(model_card())

    # ------------------------------------------------------------ generation
    @app.get("/trace/{rid}")
    async def trace_page(request: Request, rid: str) -> HTMLResponse:
        _check_key(request, config)  # the page holds the request's prompt and answer
        if config.trace <= 0:
            raise APIError(404, "tracing is off; start the server with --trace")
        _check_ready(state)
        kept = state.traces.get(rid)
        if kept is None:
            raise APIError(404, f"no trace of request {rid!r} "
                                f"(only the last {config.trace} finished requests are kept)")
        def render() -> str:  # the state comparison runs the model: on the worker thread
            from sot.trace_page import render_page

            traced = state.sot.traced([prompt for prompt, _ in kept], [result for _, result in kept])
            return render_page(state.sot.trace_run(model=state.model_name, request=rid), traced)

        page = await asyncio.wrap_future(state.worker.call(render))
        # (the page holds a user's prompt and answer: not to be kept by caches or read as another type)
        return HTMLResponse(page, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _check_key(request, config)
        body = ChatCompletionRequest.model_validate(await _json(request))
        _check_ready(state)
        return await _chat_completion(request, state, body)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, answered as the chat completion it means
        (:mod:`sot.server.responses`)."""
        _check_key(request, config)
        asked = ResponsesRequest.model_validate(await _json(request))
        _check_ready(state)
        asked.model = asked.model or state.model_name
        store = state.responses
        history = None
        if asked.previous_response_id is not None:
            if store is None:
                raise APIError(400, "previous_response_id: this server keeps no responses (--responses-kept 0); "
                                    "send the whole conversation as input", param="previous_response_id")
            history = store.history(asked.previous_response_id)
        builder = ResponseBuilder(asked)
        try:
            body = ChatCompletionRequest.model_validate(
                {**asked.chat_body(history), "stream": asked.stream,
                 "stream_options": {"include_usage": True} if asked.stream else None})
            answer = await _chat_completion(request, state, body, rid=builder.id)
        except APIError as exc:  # name the Responses fields, not the chat ones they became
            raise responses_error(exc) from None
        builder.stored = store is not None and asked.store is not False
        keep = (lambda done: store.put(done, asked, history)) if builder.stored else None
        if not asked.stream:
            chat = json.loads(answer.body)
            done = builder.whole(chat)
            if keep is not None and builder.stored:  # (not a failed one)
                keep(done)
            return JSONResponse(done)
        def finished(done: dict) -> None:
            if keep is not None and builder.stored:
                keep(done)

        return StreamingResponse(_response_events(builder, answer.body_iterator, finished),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/responses/{rid}")
    async def stored_response(request: Request, rid: str) -> JSONResponse:
        """A kept response, as it was answered."""
        _check_key(request, config)
        _check_ready(state)
        return JSONResponse(_response_store(state).get(rid))

    @app.get("/v1/responses/{rid}/input_items")
    async def response_input_items(request: Request, rid: str, limit: int = 20, order: str = "desc",
                                   after: str | None = None) -> JSONResponse:
        """The input items of a kept response (OpenAI's list, with its paging fields)."""
        _check_key(request, config)
        _check_ready(state)
        return JSONResponse(_response_store(state).input_items(rid, limit, order, after))

    @app.delete("/v1/responses/{rid}")
    async def delete_response(request: Request, rid: str) -> JSONResponse:
        _check_key(request, config)
        _check_ready(state)
        _response_store(state).delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.post("/v1/completions")
    async def completions(request: Request):
        _check_key(request, config)
        body = CompletionRequest.model_validate(await _json(request))
        _check_ready(state)
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], str)):
            texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
            prompts = await _off_loop(lambda: [state.sot.encode({"prompt": text}, chat=False) for text in texts])
        else:  # token ids, or a list of token-id prompts
            prompts = [list(p) for p in body.prompt] if body.prompt and isinstance(body.prompt[0], list) \
                else [list(body.prompt)]
            for ids in prompts:
                _check_token_ids(state, ids, "prompt")
            texts = await _off_loop(lambda: [state.sot.tokenizer.decode(ids) for ids in prompts])
        return await _generate(request, state, body, prompts, chat=False, texts=texts)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's route: a prompt's token ids (``prompt``, or chat ``messages`` with the chat
        template the completions route applies), with the count and the context length."""
        _check_key(request, config)
        body = TokenizeRequest.model_validate(await _json(request))
        _check_ready(state)
        _check_model(state, body.model)
        sot = state.sot
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            offered = checked_tools(body.tools, body.tool_choice).offered()
            tokens = await _off_loop(lambda: _chat_prompt(state, body, offered))
        else:
            tokens = await _off_loop(lambda: sot.encode({"prompt": body.prompt}, chat=False))
        return {"count": len(tokens), "max_model_len": state.context, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's route: the text of token ids."""
        _check_key(request, config)
        body = DetokenizeRequest.model_validate(await _json(request))
        _check_ready(state)
        _check_model(state, body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return {"prompt": await _off_loop(lambda: state.sot.tokenizer.decode(body.tokens))}

    return app


# ---------------------------------------------------------------------------- helpers
#: the largest request body read, in bytes (a prompt this long is far past any context)
MAX_BODY_BYTES = 64 * 2**20
#: content types a browser may send to another site without asking first: a JSON API that
#: read them would answer any web page the server's user opens (cross-site requests)
_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


async def _json(request: Request) -> Any:
    """The request's JSON body: a 415 for a form or text content type, a 403 for a request a web
    page at an origin not allowed sent, a 413 past :data:`MAX_BODY_BYTES`, a 400 for anything
    that is not JSON (nested too deep included)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in _FORM_TYPES:
        raise APIError(415, f"send the request body as JSON (Content-Type: application/json), not {kind}")
    origin = request.headers.get("origin")
    allowed = request.app.state.sot_state.config.allowed_origins
    if origin is not None and "*" not in allowed and origin not in allowed:
        # (a browser names the page a request comes from; a page elsewhere may not use this API
        # unless --allowed-origins lets it, even with a body no Content-Type names)
        raise APIError(403, f"requests from web pages at {origin} are refused; start the server with "
                            f"--allowed-origins {origin} to let them in", code="origin_not_allowed")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is {int(length):,} bytes; at most {MAX_BODY_BYTES:,} are read")
    try:
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes, the most that is read")
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, no server error
        raise APIError(499, "the client closed the connection") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON here: it nests too deep") from None


async def _off_loop(work: Callable[[], Any]) -> Any:
    """``work()`` (a chat template, tokenizing or decoding a long text) on a worker thread, so
    the event loop goes on serving the running streams and /health meanwhile."""
    return await asyncio.to_thread(work)


def _check_key(request: Request, config: ServerConfig) -> None:
    if config.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # compared as bytes (compare_digest refuses str beyond ASCII): the header's raw bytes, which
    # Starlette decodes as Latin-1, against the key's UTF-8
    sent, key = token.strip().encode("latin-1"), config.api_key.encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent, key):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def _check_model(state: ServerState, model: str | None) -> None:
    """A 404 unless ``model`` is the served one (``None``: optional and not given)."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    """A 400 naming ``param`` unless every id is a token of the model's vocabulary."""
    vocab = state.sot.target.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)


async def _chat_completion(request: Request, state: ServerState, body: ChatCompletionRequest,
                           rid: str | None = None):
    """Answer a chat completion request (whole or streamed), under the id ``rid`` (by default
    a new ``chatcmpl-`` one)."""
    use = body.tool_setup()
    offered = use.offered()
    prompt = await _off_loop(lambda: _chat_prompt(state, body, offered))
    return await _generate(request, state, body, [prompt], chat=True, tools=use, rid=rid)


def _response_store(state: ServerState) -> ResponseStore:
    if state.responses is None:
        raise APIError(404, "this server keeps no responses (--responses-kept 0)", code="not_found")
    return state.responses


async def _response_events(builder: ResponseBuilder, chunks: AsyncIterator[str],
                           keep: Callable[[dict], None] | None = None) -> AsyncIterator[str]:
    """A chat completion stream's chunks as Responses events; closing it (a client gone)
    closes the chat stream, which aborts the request. ``keep`` receives the finished
    response (a failed one too; not one whose client hung up). An error ends the stream with
    an ``error`` event, then ``response.failed``."""
    try:
        first = await chunks.__anext__()  # the chat stream starts here, so closing it always aborts
        for event in builder.opening():
            yield sse_event(event)
        usage, text = None, first
        while True:
            if text.startswith("data: {"):  # (not the final [DONE])
                chunk = json.loads(text[len("data: "):])
                if "error" in chunk:
                    yield sse_event(builder.event("error", code="internal_error", message=chunk["error"]["message"],
                                                  param=None))
                    closing = builder.closing(usage, error=chunk["error"]["message"])
                    if keep is not None:  # (a failed response is not kept, but its trace is named)
                        keep(builder.done)
                    for event in closing:
                        yield sse_event(event)
                    return
                usage = chunk.get("usage") or usage
                for event in builder.on_chunk(chunk):
                    yield sse_event(event)
            try:
                text = await chunks.__anext__()
            except StopAsyncIteration:
                break
        closing = builder.closing(usage)
        if keep is not None:  # kept before the last event leaves, so a client can continue
            keep(builder.done)
        for event in closing:
            yield sse_event(event)
    finally:
        await chunks.aclose()


def _chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict]) -> list[int]:
    """The token ids of a request's chat through the model's template, with ``tools``
    offered (OpenAI's form; none: no tools) and the request's template fields."""
    sot = state.sot
    messages = body.messages or []
    item: dict = {"messages": [m.to_dict() for m in messages]}
    if tools:
        item["tools"] = tools
    if not sot.is_chat_model:
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            raise APIError(400, "this model has no chat template, so it cannot be offered tools", param="tools")
        if body.continue_final_message or body.chat_template_kwargs:
            raise APIError(400, "this model has no chat template (start the server with --chat-template)",
                           param="messages")
    try:
        return sot.encode(item, chat=sot.is_chat_model, generation_prompt=body.add_generation_prompt,
                          continue_final=body.continue_final_message, template_kwargs=body.chat_template_kwargs)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _check_ready(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is shutting down")
    if state.load_error:
        raise APIError(503, f"the server failed to load: {state.load_error}")
    if not state.ready:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "1"})


def _params(state: ServerState, body: _GenerationRequest, prompt: list[int]) -> GenerationParams:
    """Validated generation settings of one prompt of a request."""
    _check_model(state, body.model)
    body.check_supported()
    context = state.context
    if not prompt:
        raise APIError(400, "the prompt is empty", param=body.prompt_field)
    if context and len(prompt) >= context:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {context} tokens",
                       param=body.prompt_field, code="context_length_exceeded")
    limit, field = body.token_limit(), body.limit_field()
    echo = bool(getattr(body, "echo", False))
    if limit is None:
        limit = context - len(prompt) if context else 256
    if limit < 1 and not (limit == 0 and echo):
        zero = " (0 with echo)" if isinstance(body, CompletionRequest) else ""
        raise APIError(400, f"{field} must be at least 1{zero}, got {limit}", param=field)
    limit = max(limit, 1)  # max_tokens 0: one token is decoded and dropped
    if context and len(prompt) + limit > context:
        raise APIError(400, f"the prompt's {len(prompt)} tokens plus {field}={limit} exceed this model's context "
                       f"of {context} tokens", param=field, code="context_length_exceeded")
    seed = body.seed if body.seed is not None else random.getrandbits(63)
    sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                              min_p=body.min_p, seed=seed,
                              mode=SamplingMode(body.sampling_mode), repetition_penalty=body.repetition_penalty,
                              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                              logit_bias=body.logit_bias_pairs())
    eos = () if body.ignore_eos else state.sot.eos_ids()
    eos += tuple(t for t in body.stop_token_ids or () if t not in eos)
    k = body.logprob_count()
    asked = body.structured_output()
    structured = asked[1] if asked else None
    predicted = getattr(body, "prediction", None)
    prediction = (tuple(state.sot.tokenizer.encode(predicted.text(), add_special_tokens=False))
                  if predicted is not None else ())
    if context and len(prediction) > context:
        raise APIError(400, f"the prediction's {len(prediction)} tokens exceed this model's context of {context} "
                       "tokens", param="prediction")
    params = GenerationParams(max_new_tokens=limit, sampling=sampling, stop=body.stop_strings(), eos_token_ids=eos,
                              logprobs=k, prompt_logprobs=k if echo else None, min_tokens=body.min_tokens,
                              structured=structured, skip_special_tokens=body.skip_special_tokens,
                              cache_salt=body.cache_salt, prediction=prediction)
    try:  # every setting, so that a bad one fails this request alone and not the batch it would join
        check_params(params, state.sot.target.vocab_size)
    except ConfigError as exc:
        msg = str(exc).replace("max_new_tokens", field)  # (the request's name for it)
        # (the field a message is about is the first it names: "top_k must be ...", "the logit_bias of ...")
        named = (word for word in re.findall(r"[A-Za-z_]+", msg) if word in type(body).model_fields)
        raise APIError(400, msg, param=next(named, None)) from None
    _check_token_ids(state, body.stop_token_ids or [], "stop_token_ids")
    return params


#: choices one request may ask for (its prompts times ``n``)
MAX_CHOICES = 16


def _nth_sample(params: GenerationParams, k: int) -> GenerationParams:
    """The settings of sample ``k`` of a prompt: seed ``seed + k``, so that the samples of
    ``n > 1`` differ and a seeded request still gives the same choices every time."""
    if k == 0:
        return params
    s = params.sampling
    return dataclasses.replace(params, sampling=dataclasses.replace(s, seed=s.seed + k))  # (any integer keys the noise)


def _admit(state: ServerState, count: int = 1) -> None:
    limit = state.config.max_batch + state.config.max_queue
    if count > limit:
        raise APIError(400, f"the request asks for {count} choices; this server holds at most {limit} at once",
                       param="n")
    if state.in_flight + count > limit:
        state.metrics.finished("rejected")
        raise APIError(429, f"the server is at capacity ({state.in_flight} requests in flight); retry later",
                       headers={"Retry-After": "1"})


@dataclass
class _Choice:
    """One choice of a response: its prompt, engine request and text so far."""

    index: int
    prompt: list[int]
    first_sample: bool  # the first of its prompt's ``n`` (whose prompt counts in ``usage``)
    ticket: int
    updates: asyncio.Queue
    text: TextAssembler
    logprobs: LogprobWriter | None
    done: bool = False
    #: with ``echo``: the prompt's text, returned before the completion
    echo: str | None = None
    #: with ``echo`` and ``max_tokens`` 0: the decoded token is dropped
    drop: bool = False
    #: a chat offered tools: how its text becomes content and calls
    tool: ToolAnswer | None = None


def _textless(update: Update, include_stop: bool) -> int:
    """How many of an update's last tokens add no text: an answer that ended at an
    end-of-sequence or ``stop_token_ids`` token leaves that token's text out, unless
    ``include_stop_str_in_output`` (as vLLM does; a special token has no text anyway unless
    ``skip_special_tokens`` is false)."""
    return 1 if update.finish_reason == "eos" and update.token_ids and not include_stop else 0


def _usage(choices: list[_Choice], results: list[SequenceResult | None]) -> dict:
    """``usage`` of a response: each prompt counted once (as OpenAI counts ``n`` samples)."""
    each = [usage_of(c.prompt, r, len(c.text.ids)) for c, r in zip(choices, results)]
    firsts = [u for u, c in zip(each, choices) if c.first_sample]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in each)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_so_far(choices: list[_Choice]) -> dict:
    """The usage of a streaming response up to now (each prompt counted once)."""
    prompt = sum(len(c.prompt) for c in choices if c.first_sample)
    completion = sum(len(c.text.ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _figures(results: list[SequenceResult | None]) -> dict | None:
    """SoT's figures of a response: those of its one choice, or summed over its choices
    (``mean_accept_len`` over all their steps)."""
    known = [r for r in results if r is not None]
    if len(results) == 1 or not known:
        return sot_figures(results[0])
    each = [sot_figures(r) for r in known]
    steps = sum(f["steps"] for f in each)
    tokens = sum(sum(r.accept_lengths) for r in known)
    out = {k: sum(f[k] for f in each) for k in ("steps", "drafted_tokens", "accepted_tokens", "plain_steps")}
    return {"mean_accept_len": round(tokens / steps, 4) if steps else 0.0, **out}


def _empty_logprobs(chat: bool) -> dict:
    return ({"content": [], "refusal": None} if chat else
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})


async def _generate(request: Request, state: ServerState, body: _GenerationRequest, prompts: list[list[int]],
                    chat: bool, texts: list[str] | None = None,
                    tools: ToolUse | None = None, rid: str | None = None):
    """Answer a request: ``n`` choices for each of ``prompts``, decoded side by side as
    requests of the engine (choice ``i * n + k`` is sample ``k`` of prompt ``i``); ``tools``:
    a chat's tools and tool choice, whose calls are read from each answer; ``rid``: the id
    its log line and trace go under (a Responses answer's own; by default a new one)."""
    if body.n < 1:
        raise APIError(400, f"n must be at least 1, got {body.n}", param="n")
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompt(s) times n={body.n} is more than {MAX_CHOICES} choices",
                       param="n")
    echo = isinstance(body, CompletionRequest) and body.echo
    drop = echo and body.token_limit() == 0
    asked = []
    for i, prompt in enumerate(prompts):
        params = _params(state, body, prompt)
        asked += [(prompt, _nth_sample(params, k), k == 0, texts[i] if echo and texts else None)
                  for k in range(body.n)]
    spec = asked[0][1].structured
    if spec is not None:  # compiled here, off the event loop: a bad one is the client's 400
        try:
            await asyncio.to_thread(state.sot.engine.grammars.matcher, spec)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=body.structured_output()[0]) from None
    _admit(state, len(asked))
    state.in_flight += len(asked)
    choices: list[_Choice] = []
    try:
        for i, (prompt, params, first, echoed) in enumerate(asked):
            ticket, updates = state.worker.submit(prompt, params, tenant=tenant_key(body.user), priority=body.priority)
            lp = (LogprobWriter(state.sot.tokenizer, chat, offset=len(echoed or ""),
                                skip_special=body.skip_special_tokens)
                  if params.logprobs is not None else None)
            tool = None
            if tools is not None and tools.choice.calls_tools:
                tool = ToolAnswer(state.sot.tokenizer, params.stop, tools, include_stop=body.include_stop_str_in_output,
                                  skip_special=body.skip_special_tokens, min_tokens=params.min_tokens)
            text = TextAssembler(state.sot.tokenizer, params.stop, include_stop=body.include_stop_str_in_output,
                                 skip_special=body.skip_special_tokens, min_tokens=params.min_tokens)
            choices.append(_Choice(i, prompt, first, ticket, updates, text, lp, echo=echoed, drop=drop, tool=tool))
    except BaseException:
        for c in choices:
            state.worker.abort(c.ticket)
        state.in_flight -= len(asked)
        raise
    rid = rid or ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    started = time.monotonic()
    model = body.model or state.model_name  # (the served one where the request names none)
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        running = include_usage and bool(options.continuous_usage_stats)
        events = _stream(state, choices, rid, model, chat, include_usage, body.return_token_ids, running)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finals = await asyncio.gather(*(_collect(request, state, c) for c in choices))
    finally:
        state.in_flight -= len(asked)
    for final in finals:
        if final.error:
            raise APIError(final.status, final.error, counted=True)
    state.keep_trace(rid, [(c.prompt, final.result) for c, final in zip(choices, finals)])
    out = []
    for c, final in zip(choices, finals):
        reason = FINISH_REASONS.get(final.finish_reason or "length", final.finish_reason)
        content = "" if c.drop else c.text.final_text()
        lp = None
        if c.logprobs is not None:
            lp = (c.logprobs.upto(len(content)) if content else None) or _empty_logprobs(chat)
        if c.echo is not None:
            if lp is not None and final.result is not None:
                head = prompt_logprobs_block(state.sot.tokenizer, c.prompt, final.result.prompt_logprobs)
                lp = {key: head[key] + lp[key] for key in head}
            content = c.echo + content
        message = {"role": "assistant", "content": content}
        if c.tool is not None:
            message = c.tool.message(content)
            reason = c.tool.finish_reason(content, reason)
        choice = ({"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason} if chat else
                  {"index": c.index, "text": content, "logprobs": lp, "finish_reason": reason})
        if body.return_token_ids:
            choice["token_ids"] = [] if c.drop else list(c.text.ids)
        out.append(choice)
    results = [f.result for f in finals]
    _log_request(state, rid, choices, results, [c["finish_reason"] for c in out], started)
    if drop:  # nothing was asked for past the prompt
        results = [dataclasses.replace(r, token_ids=[]) if r is not None else None for r in results]
    response = {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": model, "choices": out, "usage": _usage(choices, results), "sot": _figures(results),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = choices[0].prompt if len(prompts) == 1 else [p for p in prompts]
    return JSONResponse(response)


def _log_request(state: ServerState, rid: str, choices: list[_Choice], results: list[SequenceResult | None],
                 reasons: list[str | None], started: float) -> None:
    """One line on the ``sot.serve`` logger for a finished request (with ``--log-requests``)."""
    if not state.config.log_requests:
        return
    usage = _usage(choices, results)
    figures = _figures(results) or {}
    LOG.info("%s: %d choice(s), prompt %d tokens (%d cached), %d generated, tau %.2f, %.2f s, finish %s", rid,
             len(choices), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
             usage["completion_tokens"], figures.get("mean_accept_len", 0.0), time.monotonic() - started,
             ",".join(str(r) for r in reasons))


#: seconds between looks at whether a client waiting for a whole answer is still there
DISCONNECT_POLL = 0.5


async def _collect(request: Request, state: ServerState, choice: _Choice) -> Update:
    """Wait for a choice's last update; abort it if the client disconnects meanwhile (looked
    at every ``DISCONNECT_POLL`` seconds, also while tokens keep coming)."""
    checked = time.monotonic()
    while True:
        try:
            update: Update | None = await asyncio.wait_for(choice.updates.get(), timeout=DISCONNECT_POLL)
        except asyncio.TimeoutError:
            update = None
        final = update is not None and (update.error or update.finish_reason is not None)
        if not final and time.monotonic() - checked >= DISCONNECT_POLL:
            checked = time.monotonic()
            if await request.is_disconnected():
                state.worker.abort(choice.ticket)
                return Update([], finish_reason="abort")
        if update is None:
            continue
        if choice.logprobs is not None:
            choice.logprobs.add(update.logprobs)
        if update.error or update.finish_reason is not None:
            choice.text.add(update.token_ids, final=True, textless=_textless(update, choice.text.include_stop))
            return update
        choice.text.add(update.token_ids, final=False)


async def _stream(state: ServerState, choices: list[_Choice], rid: str, model: str, chat: bool,
                  include_usage: bool, token_ids: bool = False, running_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events of one request's choices, in the order their tokens come; if the
    client goes away the generator is closed and every unfinished choice aborted. With
    ``running_usage`` (vLLM's ``continuous_usage_stats``) every chunk carries the usage so far."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, delta: str | None, reason: str | None = None, role: bool = False,
              extra: dict | None = None, ids: list[int] | None = None, lp: dict | None = None,
              chat_delta: dict | None = None) -> str:
        if chat:
            d: dict = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            if chat_delta is not None:  # tool calls, or content that is not the text's own delta
                d = chat_delta
            choice = {"index": index, "delta": d, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": lp, "finish_reason": reason}
        if token_ids and not role:
            choice["token_ids"] = ids or []
        payload = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            payload["usage"] = _usage_so_far(choices) if running_usage else None
        payload.update(extra or {})
        return sse(payload)

    merged: asyncio.Queue = asyncio.Queue()

    async def forward(c: _Choice) -> None:
        while True:
            update: Update = await c.updates.get()
            await merged.put((c, update))
            if update.error or update.finish_reason is not None:
                return

    pumps = [asyncio.create_task(forward(c)) for c in choices]
    results: list[SequenceResult | None] = [None] * len(choices)
    traced: list[SequenceResult | None] = [None] * len(choices)  # (as decoded, for the trace)
    reasons: list[str | None] = [None] * len(choices)
    started = time.monotonic()
    logged = False
    try:
        if chat:
            for c in choices:
                yield chunk(c.index, None, role=True)
                opened = c.tool.first_delta() if c.tool is not None else None
                if opened is not None:
                    yield chunk(c.index, None, chat_delta=opened)
        for c in choices:  # with logprobs, an echoed prompt waits for its figures (the first update)
            if c.echo and c.logprobs is None:
                yield chunk(c.index, c.echo)
        left = len(choices)
        while left:
            c, update = await merged.get()
            if update.error:
                reasons[c.index] = "error"  # (for the log line)
                yield sse(APIError(update.status, update.error).body())
                break
            if c.echo and c.logprobs is not None and update.prompt_logprobs is not None:
                yield chunk(c.index, c.echo, lp=prompt_logprobs_block(state.sot.tokenizer, c.prompt,
                                                                      update.prompt_logprobs))
            last = update.finish_reason is not None
            textless = _textless(update, c.text.include_stop)
            delta = c.text.add(update.token_ids, final=last, textless=textless) if not c.drop else ""
            lp = None
            if c.logprobs is not None and not c.drop:  # those of the tokens whose text this chunk completes
                c.logprobs.add(update.logprobs)
                lp = c.logprobs.upto(c.text.sent)
            if c.tool is not None:
                said = c.tool.delta(update.token_ids[: len(update.token_ids) - textless], delta, last)
                if said or lp or (token_ids and update.token_ids):
                    yield chunk(c.index, None, ids=update.token_ids, lp=lp, chat_delta=said or {})
            elif delta or lp or (token_ids and update.token_ids and not c.drop):
                yield chunk(c.index, delta, ids=[] if c.drop else update.token_ids, lp=lp)
            if last:
                c.done = True
                left -= 1
                results[c.index] = traced[c.index] = update.result
                if c.drop and update.result is not None:
                    results[c.index] = dataclasses.replace(update.result, token_ids=[])
                reason = FINISH_REASONS.get(update.finish_reason, update.finish_reason)
                if c.tool is not None:
                    text = c.text.final_text()
                    closing = c.tool.last_delta(text)
                    if closing is not None:
                        yield chunk(c.index, None, chat_delta=closing)
                    reason = c.tool.finish_reason(text, reason)
                reasons[c.index] = reason
                yield chunk(c.index, None, reason, extra={"sot": sot_figures(update.result)})
        else:
            state.keep_trace(rid, [(c.prompt, traced[c.index]) for c in choices])
            _log_request(state, rid, choices, results, reasons, started)
            logged = True
            if include_usage:
                yield sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                           "usage": _usage(choices, results)})
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        state.in_flight -= len(choices)
        for c in choices:
            if not c.done:
                state.worker.abort(c.ticket)
        if not logged:  # (the client went away, or a choice failed: its line says how each ended)
            _log_request(state, rid, choices, results, [r or "abort" for r in reasons], started)
