"""The settings of one server, apart from the app so that the CLI's parser (which reads their
defaults) needs no web framework."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

#: finished responses a server keeps by default (``sot serve --responses-kept``)
RESPONSES_KEPT = 1000


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server (the CLI's ``sot serve`` flags).

    Attributes:
        model_name: the id served in ``/v1/models`` and required in requests.
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
        max_batch: sequences decoded together.
        max_queue: requests waiting for a slot beyond ``max_batch``; more are answered 429.
        prompt_budget: prompt tokens a step reads at most (0: whole prompts), so a long prompt
            does not stall the running streams for its whole read, and a client that leaves,
            or a shutdown, is acted on between its parts.
        shutdown_timeout: seconds running requests get to finish after SIGTERM.
        trace: finished requests whose step traces are kept for ``/trace/{id}`` (0: off).
        allowed_origins: browser origins allowed to call the API (CORS; ``("*",)``: any;
            empty: no CORS headers, so browsers refuse cross-origin calls).
        log_requests: log one line per finished request (id, finish reason, tokens, tau,
            seconds) to the ``sot.serve`` logger.
        responses_kept: finished ``/v1/responses`` answers kept for ``previous_response_id``
            and ``GET /v1/responses/{id}``, least recently used first out (0: none).
    """

    model_name: str | None = None
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    prompt_budget: int = 256
    shutdown_timeout: float = 30.0
    #: keep the step traces of the last ``trace`` finished requests, each served as a page
    #: at ``/trace/{id}`` (0: no tracing)
    trace: int = 0
    allowed_origins: tuple[str, ...] = ()
    log_requests: bool = False
    responses_kept: int = RESPONSES_KEPT
    #: requests kept when tracing is asked for without a count (``--trace``)
    TRACE_KEPT: ClassVar[int] = 64
