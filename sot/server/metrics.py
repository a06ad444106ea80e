"""The server's Prometheus metrics, named like vLLM's with the ``sot:`` prefix.

Counters are exposed with prometheus_client's ``_total`` suffix, e.g.
``sot:spec_decode_num_drafts_total``.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics, generate_latest,
)

from sot.engine import SequenceResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
#: whole requests: seconds to minutes
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


#: the final statuses ``sot:requests_total`` counts
STATUSES = ("stop", "length", "eos", "abort", "grammar", "error", "rejected", "invalid")


class ServerMetrics:
    """All metrics of one server, in their own registry."""

    def __init__(self) -> None:
        disable_created_metrics()  # no '_created' series beside every counter
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (Linux)
        self.requests = Counter("sot:requests", "Sequences (each of a request's n choices) by final status: "
                                "stop, length, eos, abort (client left or shutdown), grammar (the structured "
                                "output's grammar allowed no token, or its engine failed), error; "
                                "and whole requests turned away: "
                                "rejected (queue full), invalid (bad input)", ["status"],
                                registry=r)
        for status in STATUSES:  # (every series from the start: a rate over the first error is not lost)
            self.requests.labels(status=status)
        self.running = Gauge("sot:num_requests_running", "Sequences in the engine's batch", registry=r)
        self.waiting = Gauge("sot:num_requests_waiting", "Requests queued for a slot", registry=r)
        self.ttft = Histogram("sot:time_to_first_token_seconds", "Time from the request's submission to the "
                              "engine (once read and tokenized) to its first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("sot:e2e_request_latency_seconds", "Time from a sequence's submission to the engine "
                             "to its last token (finished sequences)", buckets=_REQUEST_BUCKETS, registry=r)
        self.queued = Histogram("sot:request_queue_time_seconds", "Time a finished sequence waited for a slot "
                                "in the batch", buckets=_REQUEST_BUCKETS, registry=r)
        self.itl = Histogram("sot:inter_token_latency_seconds", "Time per generated token after the first "
                             "(a step's gap shared by the tokens it committed)", buckets=_LATENCY_BUCKETS, registry=r)
        self.generated = Counter("sot:generation_tokens", "Generated tokens", registry=r)
        self.prompt = Counter("sot:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prompt_cached = Counter("sot:prefix_cache_hit_tokens", "Prompt tokens of finished requests taken "
                                     "from the prefix cache (not read again)", registry=r)
        self.drafts = Counter("sot:spec_decode_num_drafts", "Verify steps of a sequence with at least one "
                              "drafted token", registry=r)
        self.draft_tokens = Counter("sot:spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted = Counter("sot:spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.accepted_per_pos = Counter("sot:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted, by position in the accepted path (0 first)",
                                        ["position"], registry=r)
        self.fallbacks = Counter("sot:fallbacks", "Times a sequence fell back to plain decoding", registry=r)
        # test-time adaptation (--adapt); zero without it
        self.adapt_updates = Counter("sot:adapt_updates", "Updates of the state predictor while serving", registry=r)
        self.adapt_rollbacks = Counter("sot:adapt_rollbacks", "Updates rolled back because acceptance fell after "
                                       "them", registry=r)
        self.adapt_resets = Counter("sot:adapt_resets", "Resets to the loaded predictor (drift past the trust "
                                    "region)", registry=r)
        self.adapt_seconds = Counter("sot:adapt_seconds", "Seconds spent updating the predictor", registry=r)
        self.adapt_share = Gauge("sot:adapt_time_share", "Adaptation time as a fraction of the engine's step time",
                                 registry=r)
        self.adapt_drift = Gauge("sot:adapt_drift", "Relative distance of the predictor's weights from the loaded "
                                 "ones", registry=r)
        self._adapt_seen = {"updates": 0, "rollbacks": 0, "resets": 0, "update_seconds": 0.0}
        # what the caps hold (read when scraped)
        self.prefix_cache_bytes = Gauge("sot:prefix_cache_bytes", "Bytes of rows held by the prefix cache "
                                        "(--prefix-cache-mb caps it)", registry=r)
        self.suffix_store_tokens = Gauge("sot:suffix_store_tokens", "Tokens of earlier answers held by the suffix "
                                         "stores (all tenants together)", registry=r)
        self.suffix_stores = Gauge("sot:suffix_stores", "Suffix stores held (one, or one per user with "
                                   "--suffix-tenants user)", registry=r)
        self.responses_kept = Gauge("sot:responses_kept", "Responses kept for previous_response_id "
                                    "(--responses-kept caps them)", registry=r)

    def watch(self, prefix_bytes: Callable[[], float], suffix_tokens: Callable[[], float],
              suffix_stores: Callable[[], float], responses: Callable[[], float]) -> None:
        """Read the caches' sizes through these functions whenever the metrics are scraped."""
        self.prefix_cache_bytes.set_function(prefix_bytes)
        self.suffix_store_tokens.set_function(suffix_tokens)
        self.suffix_stores.set_function(suffix_stores)
        self.responses_kept.set_function(responses)

    # ------------------------------------------------------------ updates
    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def latency(self, total: float, queued: float) -> None:
        """A finished sequence's time from submission to its last token, and its wait for a slot."""
        self.e2e.observe(max(0.0, total))
        self.queued.observe(max(0.0, queued))

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def tokens(self, n: int) -> None:
        self.generated.inc(n)

    def step(self, drafted: tuple[int, ...], accepted_per_pos: tuple[int, ...]) -> None:
        """One verify step: ``drafted[b]`` tokens drafted for sequence ``b``; ``accepted_per_pos[d]``
        sequences whose accepted path reached draft position ``d``."""
        self.drafts.inc(sum(1 for d in drafted if d > 0))
        self.draft_tokens.inc(sum(drafted))
        self.accepted.inc(sum(accepted_per_pos))
        for pos, n in enumerate(accepted_per_pos):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)

    def adaptation(self, stats: dict) -> None:
        """The adapter's :meth:`~sot.online.adapt.Adapter.stats` after a step."""
        seen = self._adapt_seen
        for key, metric in (("updates", self.adapt_updates), ("rollbacks", self.adapt_rollbacks),
                            ("resets", self.adapt_resets), ("update_seconds", self.adapt_seconds)):
            if stats[key] > seen[key]:
                metric.inc(stats[key] - seen[key])
                seen[key] = stats[key]
        self.adapt_share.set(stats["update_seconds"] / stats["step_seconds"] if stats["step_seconds"] else 0.0)
        self.adapt_drift.set(stats["drift"])

    def finished(self, status: str, result: SequenceResult | None = None) -> None:
        self.requests.labels(status=status).inc()
        if result is not None:
            self.prompt.inc(result.prompt_tokens)
            self.prompt_cached.inc(result.cached_tokens)
            self.fallbacks.inc(result.fallbacks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
