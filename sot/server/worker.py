"""The engine behind the server: one thread steps the :class:`~sot.engine.Engine`, the HTTP
handlers talk to it through a command queue and receive their tokens on asyncio queues.

The engine is not thread-safe, so only the worker thread touches it. Handlers call
:meth:`EngineWorker.submit` and :meth:`EngineWorker.abort` from the event loop; the worker
applies those commands between steps, and hands each request's :class:`Update` back to the
loop that submitted it (``call_soon_threadsafe``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sot.engine import Engine, GenerationParams, SequenceResult
from sot.server.metrics import ServerMetrics


@dataclass(frozen=True)
class Update:
    """New tokens of one request; ``finish_reason`` is set on its last update, ``error``
    when the engine refused or lost it."""

    token_ids: list[int]
    finish_reason: str | None = None
    result: SequenceResult | None = None
    error: str | None = None
    #: with log probabilities asked for: one per token of ``token_ids``
    logprobs: list = field(default_factory=list)
    #: with the prompt's log probabilities asked for: on the first update, one per prompt
    #: token (``None`` for the first)
    prompt_logprobs: list | None = None
    #: the HTTP status of ``error``: 500 for the engine's failures, 400 for a request whose
    #: grammar the grammar engine could not follow
    status: int = 500


@dataclass
class _Ticket:
    """What the worker keeps for one submitted request."""

    prompt: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    tenant: str | None = None
    priority: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    engine_id: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


#: the error of requests the worker cannot take any more
SHUTDOWN = "the server is shutting down"


class EngineWorker:
    """Runs ``engine`` on a daemon thread until :meth:`stop`.

    Args:
        engine: the engine to step (nobody else may touch it while the worker runs).
        metrics: counters and gauges updated as requests move.
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, _Ticket] = {}  # by ticket number
        self._by_engine_id: dict[int, int] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sot-engine", daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is left and end the thread, waiting up to ``timeout`` seconds for it
        (``None``: until it ends)."""
        with self._lock:  # (a request submitted before this is failed by the thread; after it, by submit)
            self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------ called from the event loop
    def submit(self, prompt: list[int], params: GenerationParams, tenant: str | None = None, priority: int = 0
               ) -> tuple[int, asyncio.Queue]:
        """Queue a request (``tenant``: whose earlier answers may draft it; ``priority``: lower
        is admitted first); returns its ticket and the queue its :class:`Update` s arrive on."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        with self._lock:
            ticket = self._next
            self._next += 1
            if self._stopping.is_set():
                updates.put_nowait(Update([], error=SHUTDOWN))
            else:
                self._commands.put(("add", (ticket, _Ticket(prompt, params, loop, updates, tenant=tenant,
                                                            priority=priority))))
        return ticket, updates

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the worker thread between two steps (work that uses the model,
        which only this thread may touch); returns a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return future

    def abort(self, ticket: int) -> None:
        """Cancel a request (a client went away); its slot is free by the next step."""
        self._commands.put(("abort", ticket))

    def abort_all(self) -> None:
        """Cancel every request (shutdown after the grace period)."""
        self._commands.put(("abort_all", None))

    # ------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:
                self._apply_commands(block=not engine.has_unfinished())
                if not engine.has_unfinished():
                    continue
                events = engine.step()
                now = time.perf_counter()
                self._record_step()
                self.metrics.set_load(engine.num_running, engine.num_waiting)  # before clients hear of the step
                for ev in events:
                    self._deliver(ev, now)
            except Exception as exc:  # noqa: BLE001 - a failed step (or command) must not hang the clients
                self.error = f"{type(exc).__name__}: {exc}"
                self._fail_all(f"the engine failed: {self.error}")
        self._fail_all(SHUTDOWN)
        self._fail_queued(SHUTDOWN)

    def _fail_queued(self, message: str) -> None:
        """Answer the commands still queued at shutdown: a request added there gets ``message``
        as its error (it would otherwise wait for ever), a call gets it as an exception."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.metrics.finished("error")
                self._send(arg[1], Update([], error=message))
            elif kind == "call" and arg[1].set_running_or_notify_cancel():
                arg[1].set_exception(RuntimeError(message))

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.metrics.set_load(self.engine.num_running, self.engine.num_waiting)

    def _apply(self, kind: str, arg) -> None:
        if kind == "add":
            ticket, t = arg
            try:
                t.engine_id = self.engine.add_request(t.prompt, t.params, tenant=t.tenant, priority=t.priority)
            except Exception as exc:  # noqa: BLE001 - the handler validated; report anything else
                self.metrics.finished("error")
                self._send(t, Update([], error=str(exc)))
                return
            self._tickets[ticket] = t
            self._by_engine_id[t.engine_id] = ticket
        elif kind == "abort":
            t = self._tickets.pop(arg, None)
            if t is not None:
                self._by_engine_id.pop(t.engine_id, None)
                self.engine.abort(t.engine_id)
                self.metrics.finished("abort")
        elif kind == "call":
            fn, future = arg
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - the caller reports it
                    future.set_exception(exc)
        elif kind == "abort_all":
            for ticket in list(self._tickets):
                t = self._tickets.pop(ticket)
                self._by_engine_id.pop(t.engine_id, None)
                result = self.engine.result(t.engine_id)
                self.engine.abort(t.engine_id)
                self.metrics.finished("abort")
                self._send(t, Update([], finish_reason="abort", result=result))

    def _record_step(self) -> None:
        stats = self.engine.last_step
        if stats.batch:
            self.metrics.step(stats.drafted, stats.accepted_per_pos)
        adapter = getattr(self.engine, "adapter", None)
        if adapter is not None:
            self.metrics.adaptation(adapter.stats())

    def _deliver(self, ev, now: float) -> None:
        ticket = self._by_engine_id.get(ev.request_id)
        if ticket is None:
            return
        t = self._tickets[ticket]
        if ev.token_ids:
            if t.first_token_at is None:
                t.first_token_at = now
                self.metrics.first_token(now - t.submitted)
            elif t.last_token_at is not None:
                self.metrics.inter_token(now - t.last_token_at, len(ev.token_ids))
            t.last_token_at = now
            self.metrics.tokens(len(ev.token_ids))
        result = None
        if ev.finished:
            del self._tickets[ticket]
            del self._by_engine_id[ev.request_id]
            result = ev.result
            self.metrics.finished(ev.finish_reason or "length", result)
            if result is not None:  # (its clock runs from admission: the rest of the time it waited)
                self.metrics.latency(now - t.submitted, now - t.submitted - result.seconds)
        error = result.error if result is not None else None
        self._send(t, Update(list(ev.token_ids), ev.finish_reason if ev.finished else None, result, error=error,
                             logprobs=list(ev.logprobs), prompt_logprobs=ev.prompt_logprobs,
                             status=400 if error else 500))

    def _fail_all(self, message: str) -> None:
        for ticket in list(self._tickets):
            t = self._tickets.pop(ticket)
            if t.engine_id is not None:
                try:
                    self.engine.abort(t.engine_id)
                except Exception:  # noqa: BLE001 - a broken engine: the client must still hear
                    pass
            self.metrics.finished("error")
            self._send(t, Update([], error=message))
        self._by_engine_id.clear()

    @staticmethod
    def _send(t: _Ticket, update: Update) -> None:
        try:
            t.loop.call_soon_threadsafe(t.updates.put_nowait, update)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
