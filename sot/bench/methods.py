"""The decoding methods ``sot bench`` compares, behind one interface."""
from __future__ import annotations

import contextlib
import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sot.drafters import Drafter, TreeBudget
from sot.bench.memory import PeakRSS, current_rss
from sot.engine import Engine, GenerationParams, PhaseTimes, SequenceResult
from sot.errors import ConfigError
from sot.prefix_cache import PrefixCache
from sot.models.adapter import TargetModel
from sot.policy import PolicyConfig

#: ``suffix``: suffix trees and prompt lookup; ``auto``: the default drafter, as ``sot generate``
#: uses it (the state predictor with suffix trees and prompt lookup where a predictor fits)
METHODS = ("hf", "hf-pld", "plain", "pld", "suffix", "state", "auto", "llamacpp")


@dataclass
class RunRecord:
    """One method on one prompt."""

    method: str
    prompt_index: int
    prompt_id: str
    prompt_tokens: int
    new_tokens: int
    wall_time: float
    ttft: float
    token_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    tree_sizes: list[int] = field(default_factory=list)
    plain_steps: int = 0
    fallbacks: int = 0
    peak_rss: int = 0
    rss_growth: int = 0
    turn: int = 0  # 1-based turn of a conversation (0: a single-turn prompt)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


def forget_answers(method: "BenchMethod") -> None:
    """Empty the global suffix store of an engine method's drafter (if it keeps one) and its
    prefix cache."""
    if isinstance(method, EngineMethod):
        if method.engine.drafter.suffix_stores is not None:
            method.engine.drafter.suffix_stores.clear()
        if method.engine.prefix_cache is not None:
            method.engine.prefix_cache.clear()


class BenchMethod(ABC):
    """Generates a continuation of a token-id prompt and reports what it measured."""

    name: str
    uses_engine = False

    @abstractmethod
    def run(self, prompt: list[int], params: GenerationParams) -> RunRecord:
        """Generate for one prompt; ``prompt_index``/``prompt_id`` are filled by the caller."""


class EngineMethod(BenchMethod):
    """The SoT engine with a given drafter (``plain`` is drafter ``none``)."""

    uses_engine = True

    def __init__(self, name: str, target: TargetModel, drafter: Drafter, budget: TreeBudget,
                 policy: PolicyConfig | None = None, prefix_cache_mb: int = 0) -> None:
        self.name = name
        prefix = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        self.engine = Engine(target, drafter, budget, policy=policy, prefix_cache=prefix)

    def run(self, prompt: list[int], params: GenerationParams) -> RunRecord:
        return self.run_batch([prompt], params)[0]

    def run_batch(self, prompts: list[list[int]], params: GenerationParams,
                  batch_size: int | None = None) -> list[RunRecord]:
        """Decode ``prompts`` in one continuous batch of at most ``batch_size`` sequences
        (default: all at once). Each record gets a share of the call's wall time (and phase
        times) proportional to its new tokens, so totals add up to the call."""
        before = copy.copy(self.engine.times)
        t0 = time.perf_counter()
        results = self.engine.generate(prompts, params, batch_size)
        return _records(self.name, prompts, results, time.perf_counter() - t0, before, self.engine.times)


#: prompt tokens a lockstep step reads at most (``sot bench --prompt-budget``): two identical
#: plain engines at batch 16 on 2 AVX2 cores agreed within 2.5% with 64 (1-5% with 256, up to
#: 15% with whole prompts, one step of seconds the other engine's steps cannot share)
LOCKSTEP_PROMPT_BUDGET = 64


class LockstepStopped(KeyboardInterrupt):
    """Ctrl-C during :func:`run_lockstep`: ``finished`` holds, by method, the records of the
    sequences that method had finished (each timed with its share of the steps so far)."""

    def __init__(self, finished: dict[str, list[RunRecord]]) -> None:
        super().__init__()
        self.finished = finished
        self.runs: list[RunRecord] = []  # (the caller's, once indexed)


def run_lockstep(methods: list[EngineMethod], prompts: list[list[int]], params: GenerationParams,
                 batch_size: int, on_done: Callable[[str, int], None] | None = None,
                 prompt_budget: int | None = LOCKSTEP_PROMPT_BUDGET) -> dict[str, list[RunRecord]]:
    """Every method decodes all of ``prompts`` as a continuous batch of ``batch_size``, the
    engines taking turns a step at a time; the method that goes first rotates every round.

    A batch of 16 takes one call per method, tens of seconds, and a shared machine's speed
    drifts by more than the difference being measured between such calls. Taking turns by
    step puts both methods in the same seconds of the machine. That needs short steps: read
    whole, a batch's prompts are one step of seconds (16 ShareGPT prompts: 3.4-5.1 s on 2
    AVX2 cores, as long as the 64 decode steps after them), and two identical engines then
    differed by up to 15%. So each step reads at most ``prompt_budget`` prompt tokens
    (``None``: whole prompts), the rest on later steps while the admitted sequences decode,
    as ``sot serve`` reads prompts; the two identical engines then agreed within 2.5%.

    Each method is timed on its own steps only: a record gets the share of its method's step
    time proportional to its new tokens (as :meth:`EngineMethod.run_batch` shares one call's
    time). ``rss_growth`` is what the method's own steps added to the process's RSS;
    ``peak_rss`` is the process's peak over the whole run, all methods together.
    ``on_done(method, n)``: ``n`` more of the method's sequences finished. Records are in
    prompt order, with ``prompt_index`` set; Ctrl-C raises :class:`LockstepStopped` with
    those of the sequences already finished."""
    names = [m.name for m in methods]
    clock = dict.fromkeys(names, 0.0)
    grown = dict.fromkeys(names, 0)
    before = {m.name: copy.copy(m.engine.times) for m in methods}
    with contextlib.ExitStack() as stack:
        for m in methods:
            stack.callback(setattr, m.engine, "prompt_budget", m.engine.prompt_budget)
            m.engine.prompt_budget = prompt_budget
        results = {m.name: stack.enter_context(m.engine.offline_batch(prompts, params, batch_size)) for m in methods}
        mem = stack.enter_context(PeakRSS())

        def records(finished_only: bool) -> dict[str, list[RunRecord]]:
            out = {}
            for m in methods:  # (the step time is shared by every sequence's tokens so far)
                recs = _records(m.name, prompts, results[m.name], clock[m.name], before[m.name], m.engine.times)
                for j, r in enumerate(recs):
                    r.prompt_index, r.peak_rss, r.rss_growth = j, mem.peak, grown[m.name]
                out[m.name] = [r for r in recs if not finished_only or r.prompt_index in done[m.name]]
            return out

        done: dict[str, set[int]] = {name: set() for name in names}  # finished sequences, by method
        turn = 0
        try:
            while any(m.engine.has_unfinished() for m in methods):
                for m in methods[turn % len(methods):] + methods[: turn % len(methods)]:
                    if not m.engine.has_unfinished():
                        continue
                    left = m.engine.num_waiting + m.engine.num_running
                    rss = current_rss()
                    t0 = time.perf_counter()
                    events = m.engine.step()
                    clock[m.name] += time.perf_counter() - t0
                    done[m.name].update(e.sequence for e in events if e.finished)
                    grown[m.name] += max(0, current_rss() - rss)
                    if on_done is not None:
                        finished = left - m.engine.num_waiting - m.engine.num_running
                        if finished:
                            on_done(m.name, finished)
                turn += 1
        except KeyboardInterrupt:
            raise LockstepStopped(records(finished_only=True)) from None
        return records(finished_only=False)


def _records(name: str, prompts: list[list[int]], results: list[SequenceResult], wall: float, before: PhaseTimes,
             after: PhaseTimes) -> list[RunRecord]:
    """One record per result of a batch that took ``wall`` seconds, each with the share of
    the wall and phase times proportional to its new tokens (so totals add up)."""
    phases = {
        "draft": after.draft - before.draft,
        "verify": after.verify - before.verify + after.prefill - before.prefill,
    }
    phases["bookkeeping"] = max(0.0, wall - phases["draft"] - phases["verify"])
    total = max(1, sum(r.new_tokens for r in results))
    out = []
    for prompt, res in zip(prompts, results):
        share = res.new_tokens / total if len(results) > 1 else 1.0
        out.append(RunRecord(
            method=name, prompt_index=-1, prompt_id="", prompt_tokens=len(prompt), new_tokens=res.new_tokens,
            wall_time=wall * share, ttft=res.first_token_seconds, token_ids=res.token_ids,
            accept_lengths=res.accept_lengths, depth_attempts=res.depth_attempts, depth_accepts=res.depth_accepts,
            phase_seconds={k: v * share for k, v in phases.items()}, tree_sizes=res.tree_sizes,
            plain_steps=res.plain_steps, fallbacks=res.fallbacks, cached_tokens=res.cached_tokens,
        ))
    return out


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.calls = 0

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class HFMethod(BenchMethod):
    """transformers ``generate``; with ``lookup`` > 0, its prompt lookup decoding."""

    def __init__(self, name: str, model: torch.nn.Module, lookup: int = 0) -> None:
        self.name = name
        self.model = model
        self.lookup = lookup

    def run(self, prompt: list[int], params: GenerationParams) -> RunRecord:
        sp = params.sampling
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, do_sample=not sp.greedy)
        if not sp.greedy:
            kwargs.update(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None, min_p=sp.min_p or None)
            torch.manual_seed(sp.seed)
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = self.lookup
        eos = list(params.eos_token_ids) or None
        ids = torch.tensor([prompt], device=self.model.device)
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        clock.start = t0
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), eos_token_id=eos, pad_token_id=(eos or [0])[0],
                streamer=clock, **kwargs,
            )
        wall = time.perf_counter() - t0
        new = out[0, len(prompt) :].tolist()
        if eos:  # generate pads nothing for batch 1, but be safe about trailing pads
            for i, tok in enumerate(new):
                if tok in eos:
                    new = new[: i + 1]
                    break
        return RunRecord(
            method=self.name, prompt_index=-1, prompt_id="", prompt_tokens=len(prompt), new_tokens=len(new),
            wall_time=wall, ttft=clock.first or wall, token_ids=new,
        )


class LlamaCppMethod(BenchMethod):
    """llama.cpp through ``llama-cpp-python`` on the same GGUF file (optional)."""

    #: llama.cpp's context at first (its KV cache is made whole: the default model's 8,192
    #: positions would add about 90 MB); :meth:`fit` widens it for longer prompts
    CONTEXT = 4096

    def __init__(self, gguf_path: str, threads: int = 2) -> None:
        from llama_cpp import Llama  # type: ignore[import-not-found]

        self.name = "llamacpp"
        self._open = lambda n_ctx: Llama(model_path=gguf_path, n_threads=threads, n_ctx=n_ctx, verbose=False)
        self.llm = self._open(self.CONTEXT)

    def fit(self, positions: int) -> None:
        """Make room for ``positions`` (a prompt and its answer), up to the model's own context;
        a :class:`ConfigError` beyond it."""
        if positions <= self.llm.n_ctx():
            return
        arch = self.llm.metadata.get("general.architecture", "llama")
        limit = int(self.llm.metadata.get(f"{arch}.context_length", positions))
        if positions > limit:
            raise ConfigError(f"llamacpp: a prompt and its answer take {positions} positions, more than the model's "
                              f"context of {limit}")
        self.llm = self._open(min(limit, -(-positions // 256) * 256))

    def run(self, prompt: list[int], params: GenerationParams) -> RunRecord:
        sp = params.sampling
        self.llm.reset()
        t0 = time.perf_counter()
        first = None
        new: list[int] = []
        if hasattr(self.llm, "set_seed"):
            self.llm.set_seed(sp.seed)
        gen = self.llm.generate(
            prompt, temp=sp.temperature, top_k=1 if sp.greedy else sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            repeat_penalty=1.0
        )
        for tok in gen:
            if first is None:
                first = time.perf_counter() - t0
            new.append(int(tok))
            if tok in params.eos_token_ids or len(new) >= params.max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return RunRecord(
            method=self.name, prompt_index=-1, prompt_id="", prompt_tokens=len(prompt), new_tokens=len(new),
            wall_time=wall, ttft=first or wall, token_ids=new,
        )
