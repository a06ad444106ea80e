"""SoT for asyncio programs: :class:`AsyncSoT` runs the engine on its own thread, as
``sot serve`` does, so requests made from any number of coroutines decode together as one
continuous speculative batch, each streamed as its tokens are committed.

    import asyncio
    from sot import SoT
    from sot.aio import AsyncSoT

    async def main():
        async with AsyncSoT(SoT.load("default"), max_batch=4) as engine:
            async for piece in engine.stream("Write a haiku about the sea.", max_new_tokens=48):
                print(piece.text, end="", flush=True)
            answers = await asyncio.gather(*(engine.generate(q, max_new_tokens=32) for q in ("Hi!", "2+2?")))

    asyncio.run(main())

Each request's tokens are those :meth:`sot.api.SoT.generate` gives it: its output does not
depend on what else is in the batch. Leaving a stream early (``break``, a cancelled task)
aborts the request and frees its slot.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from sot.api import SoT, StreamEvent
from sot.errors import ConfigError, SoTError
from sot.prompts import PromptItem
from sot.requests import SequenceResult, check_number, check_request, check_routing
from sot.server.metrics import ServerMetrics
from sot.detokenize import TextAssembler
from sot.server.worker import EngineWorker


@dataclass(frozen=True)
class AsyncCompletion:
    """A whole answer from :meth:`AsyncSoT.generate`: its text and the engine's figures."""

    text: str
    result: SequenceResult

    @property
    def token_ids(self) -> list[int]:
        return self.result.token_ids

    @property
    def finish_reason(self) -> str:
        return self.result.finish_reason


class AsyncSoT:
    """An asyncio front to a loaded :class:`~sot.api.SoT`.

    Args:
        sot: the loaded model and engine; while this object runs, only its thread may use
            the engine (don't call ``sot.generate`` meanwhile).
        max_batch: sequences decoded together; more requests wait for a slot.
    """

    def __init__(self, sot: SoT, max_batch: int = 8) -> None:
        check_number("max_batch", max_batch, integer=True, low=1)
        if sot._async_front is not None:  # two threads must not step one engine
            raise ConfigError("this SoT already has a running AsyncSoT; close it first, or share it")
        if sot.engine.has_unfinished():  # (its thread would finish them, and their caller would lose them)
            raise ConfigError("the engine has unfinished requests (a SoT.stream not read to its end, or "
                              "add_request): finish or abort them before starting an AsyncSoT")
        sot._async_front = self
        self.sot = sot
        self._max_batch = sot.engine.max_batch  # (given back on close)
        sot.engine.max_batch = max_batch
        self._worker = EngineWorker(sot.engine, ServerMetrics())
        self._worker.start()

    async def __aenter__(self) -> "AsyncSoT":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """Stop the engine thread (requests still running end with an error), waiting for its
        step in progress to end; then the engine's batch limit is given back and the SoT is
        free for other use. (Blocks for up to one engine step: in a coroutine, use
        :meth:`aclose`.)"""
        self._worker.stop(timeout=None)
        if self._worker.alive:  # (not reached: the wait has no limit; never free an engine still stepped)
            raise SoTError("the engine thread did not stop; the SoT stays taken")
        self.sot.engine.max_batch = self._max_batch
        if self.sot._async_front is self:
            self.sot._async_front = None

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

    async def stream(self, prompt: PromptItem, chat: bool | None = None, tenant: str | None = None,
                     priority: int = 0, **kwargs: Any) -> AsyncIterator[StreamEvent]:
        """Yield the text of one prompt as it is committed (``index`` 0; the last event has
        ``finished``), ending before a stop string. Keyword arguments are those of
        :meth:`sot.api.SoT.params`; ``tenant`` keys the earlier answers it may draft from
        (with ``suffix_per_tenant``); a waiting request of lower ``priority`` goes first.

        A loop that stops reading early should close the stream, so that the request is
        aborted at once rather than when the generator is collected::

            async with contextlib.aclosing(aio.stream("Hi")) as events:
                async for event in events:
                    if "done" in event.text:
                        break
        """
        async for event, _ in self._run(prompt, chat, tenant, priority, kwargs):
            yield event

    async def generate(self, prompt: PromptItem, chat: bool | None = None, tenant: str | None = None,
                       priority: int = 0, **kwargs: Any) -> AsyncCompletion:
        """The whole answer to one prompt (arguments as for :meth:`stream`)."""
        pieces, result = [], None
        async for event, result in self._run(prompt, chat, tenant, priority, kwargs):
            pieces.append(event.text)
        return AsyncCompletion("".join(pieces), result)

    async def _run(self, prompt: PromptItem, chat: bool | None, tenant: str | None, priority: int,
                   kwargs: dict) -> AsyncIterator[tuple[StreamEvent, SequenceResult | None]]:
        """One request's events, each with the request's result (``None`` until the last)."""
        if not self._worker.alive:
            raise SoTError("this AsyncSoT is closed")
        params = self.sot.params(**kwargs)
        ids = self.sot.encode(prompt, chat)
        # refused here, with the engine's own error (a PromptTooLongError...), not in its thread
        check_request(ids, params, self.sot.target.max_positions, self.sot.target.vocab_size)
        check_routing(tenant, priority)
        ticket, updates = self._worker.submit(ids, params, tenant=tenant, priority=priority)
        # (as the server's streams: stops held back)
        text = TextAssembler(self.sot.tokenizer, params.stop, min_tokens=params.min_tokens,
                             skip_special=params.skip_special_tokens)
        done = False
        try:
            while not done:
                update = await updates.get()
                if update.error:
                    done = True
                    raise SoTError(f"the request failed: {update.error}")
                done = update.finish_reason is not None
                piece = text.add(update.token_ids, final=done)
                if piece or done or update.token_ids:  # (tokens whose text is held back come too)
                    yield StreamEvent(0, piece, list(update.token_ids), done, update.finish_reason), update.result
        finally:
            if not done:  # left early: free the slot
                self._worker.abort(ticket)
