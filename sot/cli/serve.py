"""``sot serve`` and ``sot bench-serve``: their flags and entry points."""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import threading
from pathlib import Path

from sot.cli.common import (
    add_adapt_args, add_drafter_args, add_model_args, check_load_args, load_sot, non_negative_float, non_negative_int,
    positive_float, positive_rate,
    positive_int, save_suffix_store,
)
from sot.errors import ConfigError


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from sot.server.config import ServerConfig

    p = sub.add_parser("serve", help="serve the OpenAI API (chat and text completions, streaming, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize, /detokenize and /trace "
                        "pages (/health, /version and /metrics stay open); default: the SOT_API_KEY environment "
                        "variable, which keeps the key out of the process list"),
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    add_drafter_args(p)
    p.add_argument("--suffix-tenants", choices=("shared", "user"), default="shared",
                   help="earlier answers drafted from: shared by all requests, or kept apart per request 'user' "
                        "field, so one user's answers never draft another's (drafting stays lossless either way, "
                        "but shared drafts can leak through timing)")
    p.add_argument("--max-batch", type=positive_int, default=ServerConfig.max_batch, help="sequences decoded together")
    p.add_argument("--max-queue", type=positive_int, default=ServerConfig.max_queue,
                   help="requests that may wait for a slot; beyond that the server answers 429")
    p.add_argument("--prompt-budget", type=non_negative_int, default=ServerConfig.prompt_budget,
                   help="prompt tokens a step reads at most; a longer prompt is read over several steps, so running "
                        "streams keep going and a client that leaves is dropped between them (0: read each prompt "
                        "whole; the output is the same either way)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=ServerConfig.shutdown_timeout,
                   help="seconds running requests get to finish after SIGTERM or Ctrl-C before they are ended "
                        "(default %(default)s; a second signal ends them at once, a third exits)")
    p.add_argument("--trace", type=int, nargs="?", const=ServerConfig.TRACE_KEPT, default=ServerConfig.trace,
                   metavar="N", help="record every step of each request and serve the last N finished ones "
                   f"(default {ServerConfig.TRACE_KEPT}) as pages at /trace/{{id}}, the id of the completion or "
                   "of the Responses answer")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--responses-kept", type=non_negative_int, default=ServerConfig.responses_kept, metavar="N",
                   help="finished /v1/responses answers kept for previous_response_id and GET /v1/responses/{id}, "
                        "least recently used first out (0: none)")
    p.add_argument("--log-requests", action="store_true",
                   help="log one line per finished request: id, tokens, tau, seconds, finish reason")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the API (CORS), or '*' for any "
                        "(default: none)")
    add_model_args(p)
    add_adapt_args(p)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM or Ctrl-C; returns 0 after a graceful shutdown."""
    import uvicorn

    from sot.server.app import create_app
    from sot.server.config import ServerConfig

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    check_load_args(args)  # (before the port is taken: a bad option is one line, not a failed load)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SOT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty (--api-key or SOT_API_KEY): give a key, or neither for no key")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give a name, or leave it out for the model's own")
    config = ServerConfig(model_name=args.served_model_name, api_key=api_key, max_batch=args.max_batch,
                          max_queue=args.max_queue, prompt_budget=args.prompt_budget,
                          shutdown_timeout=args.shutdown_timeout, trace=args.trace,
                          allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
                          log_requests=args.log_requests, responses_kept=args.responses_kept)
    if args.log_requests:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s sot serve: %(message)s"))
        log = logging.getLogger("sot.serve")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if args.trace < 0:
        raise ConfigError(f"--trace takes a count of requests to keep, got {args.trace}")
    if args.lora is not None and not (Path(args.lora) / "adapter_config.json").is_file():
        raise ConfigError(f"--lora: {args.lora} is not a LoRA adapter folder (no adapter_config.json)")
    if args.chat_template is not None:  # a missing file is an error now, not once the model loads
        from sot.prompts import read_chat_template

        args.chat_template = read_chat_template(args.chat_template)
    sock = _listen(args.host, args.port)
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}"

    def loaded(error: str | None) -> None:
        if error is None:
            print(f"sot serve: ready on {url} (model {state.model_name})", file=sys.stderr)
        else:  # nothing to serve: stop now rather than answer 503 until someone notices
            print(f"sot serve: error: failed to load: {error}", file=sys.stderr)
            server.should_exit = True

    app = create_app(lambda: load_sot(args), config, on_loaded=loaded)
    state = app.state.sot_state

    signals = []

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM / SIGINT
            signals.append(sig)
            if len(signals) == 2:  # a second one: end the running requests now, their streams closed properly
                print("sot serve: ending the running requests now (a third signal exits at once)", file=sys.stderr)
                if state.worker is not None:
                    state.worker.abort_all()
                return
            if len(signals) > 2:  # (uvicorn forces an exit on a repeated Ctrl-C only: SIGTERM too)
                self.force_exit = True
            if not state.draining:
                state.draining = True  # new requests get 503; running ones may finish
                print("sot serve: shutting down; running requests may finish "
                      f"(at most {config.shutdown_timeout:g} s)", file=sys.stderr)

                def end_the_rest() -> None:
                    if state.worker is not None:
                        state.worker.abort_all()

                timer = threading.Timer(config.shutdown_timeout, end_the_rest)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                # uvicorn re-raises the signal after its shutdown; a graceful stop exits 0
                self._captured_signals.clear()

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=config.shutdown_timeout + 5))
    print(f"sot serve: listening on {url}; loading the model (GET /health answers 200 when ready)",
          file=sys.stderr)
    server.run(sockets=[sock])
    if state.sot is None and state.load_error is None:  # stopped while the model was still loading
        # (the loading thread may be inside compiled code, which the interpreter's exit would end
        # with an abort): nothing to save or stop, so leave at once
        print("sot serve: stopped before the model had loaded", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if state.worker is not None:  # (done by the app's shutdown, unless a third signal skipped it)
        state.worker.stop()
    if state.load_error:
        return 1
    if state.sot is not None:
        save_suffix_store(state.sot, args)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, or a ConfigError a user can act on (port taken, no such
    address): checked before the model loads, and before anything says the server started."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # (a second server binding the port at the same moment fails here, not in uvicorn)
    except OSError as exc:
        sock.close()
        hint = " (another server uses it; pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def add_bench_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-serve", help="load-test OpenAI-compatible servers side by side")
    p.add_argument("--url", action="append", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (repeat to compare servers)")
    p.add_argument("--label", action="append", default=None, help="a name per --url (default: the URL)")
    p.add_argument("--model", default=None, help="model id to request (default: the server's first model)")
    p.add_argument("--api-key", action="append", default=None,
                   help="the servers' key: once for all, or once per --url in their order")
    p.add_argument("--prompts", default="sharegpt-heldout",
                   help="a bench prompt set (sharegpt-heldout, humaneval, ...) or a .jsonl file")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="requests per level and server")
    p.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels")
    p.add_argument("--request-rate", type=positive_rate, default=None,
                   help="send requests at this Poisson rate (per second; inf: all at once) instead of fixed "
                        "concurrency")
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens tokens (the 'ignore_eos' extension of SoT and vLLM)")
    p.add_argument("--rounds", type=positive_int, default=1, help="alternating rounds per level")
    p.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds one request may take, from sending it to its last token; a request still "
                        "running then is ended and counted as failed")
    p.add_argument("--out", default=None, help="folder for results.json and bench-serve.png")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from sot.server.bench import cmd_bench_serve as run

    return run(args)
