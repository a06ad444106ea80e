"""The step-level engine: requests join and leave between steps, and each step runs
plan -> draft -> verify -> accept -> commit over the live sequences.

Requests are added with :meth:`Engine.add_request` (each with its own settings), cancelled
with :meth:`Engine.abort`, and advanced by :meth:`Engine.step`, which returns the tokens
committed in that step. :meth:`Engine.generate` and :meth:`Engine.stream` are loops over it,
and so is the server: the offline and served paths are one code path.

Every live sequence keeps its own cache length, tree, acceptance and stopping state, and
every row of a verify pass is computed independently of the others, so a request's output
does not depend on what else shares its steps. The live sequences occupy cache slots
``[0, n)``: when one leaves, the last one moves into its slot, so finished sequences never
take rows in the verify pass.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterator, Protocol

import torch

from sot.acceptance import Acceptance
from sot.attention import MAX_TREE_DEPTH, MAX_TREE_NODES
from sot.cache import KVCache
from sot.drafters.base import DraftInput, Drafter, DrafterKind, DraftRules, TreeBudget
from sot.errors import ConfigError
from sot.logit_rules import AdjustedRows, adjusts
from sot.models.adapter import ForwardOutput, TargetModel
from sot.models.rows import ROW_UNIT, round_up
from sot.policy import (
    AcceptanceModel, CommitPolicy, CostModel, PolicyConfig, PolicyKind, RLPolicyModel, StepOutcome, StepPlan, Trace,
    resolve_policy, resolve_rl_policy,
)
from sot.packing import pack_trees
from sot.prefix_cache import PrefixCache, PrefixHit
from sot.requests import (
    GenerationParams, LiveRequest, PhaseTimes, SequenceResult, StagedPrompt, StepStats, TokenEvent, check_number,
    check_prompts, check_request, check_routing,
)
from sot.sampling import CoupledDraw, sequence_generator, token_logprobs
from sot.structured import Grammars
from sot.trace import build_record, record_step, step_mode
from sot.tree import DraftTree
from sot.verify import accept_all, accept_tree, record_depths

#: the request and result types live in :mod:`sot.requests`; importing them from here works too
__all__ = ["Engine", "GenerationParams", "PhaseTimes", "SequenceResult", "StepObserver", "StepStats", "TokenEvent",
           "check_request"]


class StepObserver(Protocol):
    """What the engine tells an observer (see ``Engine(observers=...)``)."""

    def prefilled(self, seq: LiveRequest, states: torch.Tensor | None, logits: torch.Tensor) -> None:
        """A prompt was read: the target's ``states [P, S', D]`` at its positions (all the
        layers the target returns) and ``logits [V]`` at its last position."""

    def verified(self, seqs: list[LiveRequest], trees: list[DraftTree], out: ForwardOutput,
                 paths: list[list[int]], drafted: set[int]) -> None:
        """A verify pass over ``seqs`` (slot order) ran: their ``trees``, the pass's output
        (``out.seq_logits(b) [T_b, V]``, ``out.seq_states(b) [T_b, S', D]``), each accepted
        path (node indices, root first) and the ids of the sequences the drafter drafted for.
        Called before the accepted tokens are committed. The walks have computed the logits
        rows they read (the accepted paths' among them: ``out.rows([out.seq_start(b) + i for i
        in path])``); other rows are computed when read, outside the step's timings."""

    def finished(self, seq: LiveRequest) -> None:
        """``seq`` left the engine (finished or aborted)."""

    def between_steps(self) -> None:
        """Called at the start of every step, before anything of it runs (so the previous
        step's tokens are already out): the place for work that must not delay a step."""


class Engine:
    """Tree-speculative decoding over a :class:`TargetModel`, one step at a time.

    Args:
        target: the wrapped target model.
        drafter: proposes trees; :class:`sot.drafters.NoDrafter` gives plain decoding.
        budget: node and depth limits of each tree.
        decode: ``token_ids -> text`` used for stop strings and results.
        trace: keep the logits row behind every committed token (for exactness checks).
        policy: the commit policy (default: heuristic); ignored for plain decoding. With
            ``static``, a state drafter grows a fixed beam of its ``top_k`` nodes per depth to
            ``budget.grown_depth``, verified whole (the node limits are raised to fit it).
        acceptance_model: the model of the ``learned`` policy (default: loaded from
            ``policy.model_path``, or the one shipped for the default model).
        record_policy: verify every tree whole, with the sequence's free drafts merged in, and
            log the commit policy's features and the outcome of every node, and every step's
            trees and target tokens, in ``self.policy_trace`` (training data of ``learned``
            and ``rl``).
        max_batch: sequences decoded together at most (``None``: every request admitted at
            once); the others wait, first come first served.
        record_steps: keep a :class:`~sot.trace.StepRecord` of every verify step in each
            result (the proposed tree, what the policy kept, what was accepted, the target's
            probabilities, the step's time split; the state drafter's predicted states).
        rl_model: the network of the ``rl`` policy (default: loaded from ``policy.model_path``,
            or the one shipped for the default model).
        observers: :class:`StepObserver` objects told of every prompt pass, verify pass and
            finished sequence, and called before each step (on-policy recording, test-time
            adaptation of the drafter). The target may return more state layers than the
            drafter reads (e.g. its final state, for a recorder): the drafter gets its own.
        prefix_cache: the rows of earlier prompts and answers, reused by prompts that start
            with the same tokens (:mod:`sot.prefix_cache`; exact, so the output is the same
            without it).
        prompt_budget: the prompt tokens a step reads at most (``None``: every admitted prompt
            whole). A longer prompt is read over several steps into a cache of its own, so the
            running sequences keep getting tokens meanwhile, and between those steps a caller
            can abort it or add requests (a server stays responsive while a long prompt is
            read, even with nothing else decoding); the output is the same either way (a
            prompt's rows do not depend on its split).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        budget: TreeBudget = TreeBudget(),
        decode: Callable[[list[int]], str] | None = None,
        trace: bool = False,
        policy: PolicyConfig | None = None,
        acceptance_model: AcceptanceModel | None = None,
        record_policy: bool = False,
        max_batch: int | None = None,
        record_steps: bool = False,
        rl_model: RLPolicyModel | None = None,
        observers: list[StepObserver] | None = None,
        prefix_cache: PrefixCache | None = None,
        prompt_budget: int | None = None,
    ) -> None:
        budget.check(MAX_TREE_DEPTH, MAX_TREE_NODES)
        if max_batch is not None and max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if prompt_budget is not None and prompt_budget < 1:
            raise ConfigError(f"prompt_budget must be >= 1, got {prompt_budget}")
        missing = set(drafter.state_layers) - set(target.state_layers)
        if missing:
            raise ConfigError(f"the drafter needs target states of layers {sorted(missing)}")
        self.policy_config, acceptance_model = resolve_policy(policy or PolicyConfig(), drafter, target,
                                                              acceptance_model, record_policy)
        self.rl_model = resolve_rl_policy(self.policy_config, drafter, target, rl_model, record_policy)
        if self.policy_config.kind is PolicyKind.STATIC and drafter.static_width > 0:
            width = drafter.static_width
            depth = budget.grown_depth
            budget = TreeBudget(max_nodes=1 + width * depth, max_depth=depth, width=width,
                                predictor_nodes=1 + width * depth, predictor_depth=depth)
        self.target = target
        self.drafter = drafter
        self.budget = budget
        self.decode = decode or (lambda ids: "")
        self._decodes = decode is not None  # (stop strings need text)
        #: the text of tokens with special tokens kept, for requests with ``skip_special_tokens``
        #: false (set by :meth:`sot.api.SoT.load`; ``None``: ``decode`` serves them too)
        self.decode_special: Callable[[list[int]], str] | None = None
        #: grammar matchers for structured output (set by :meth:`sot.api.SoT.load`, which
        #: knows the tokenizer); ``None``: requests with ``structured`` are refused
        self.grammars: Grammars | None = None
        self.times = PhaseTimes()
        self.trace = trace
        self.record_policy = record_policy
        # recording verifies each drafted tree with its free drafts merged in (at most twice the size)
        self._max_tree = budget.max_nodes * (2 if record_policy else 1)
        self.max_batch = max_batch
        self.record_steps = record_steps
        self._proposed: dict[int, tuple[str, DraftTree]] = {}  # this step's, while recording
        self.acceptance_model = acceptance_model
        self._ids = itertools.count()
        self._waiting: list[LiveRequest] = []
        self._offline = False  # inside an offline call (offline_batch): its requests are all there is
        # one offline call at a time: a call from another thread waits for the running one to end
        self._call_lock = threading.Lock()
        self._call_thread: int | None = None  # the thread whose offline call holds the engine
        self._running: list[LiveRequest] = []  # running[b] holds cache slot b
        self._cache: KVCache | None = None
        self._policy: CommitPolicy | None = None
        self.last_step = StepStats()
        self.observers: list[StepObserver] = list(observers or [])
        self.prefix_cache = prefix_cache
        self.prompt_budget = prompt_budget
        #: the test-time adapter of the drafter (:class:`sot.online.adapt.Adapter`), once attached
        self.adapter = None
        layers = tuple(target.state_layers)
        pick = [layers.index(x) for x in drafter.state_layers]
        # the drafter's layers among the target's, when the target returns more (else None)
        self._pick = None if pick == list(range(len(layers))) else torch.tensor(pick, dtype=torch.long)

    #: tokens of room the cache grows by, past the longest sequence (at least; it grows by half)
    GROW_STEP = 256

    def cost_model(self) -> CostModel:
        """Verify time by row count on this machine, measured once per target and tree size."""
        return CostModel.for_target(self.target, self.budget.max_nodes)

    @property
    def policy(self) -> CommitPolicy:
        """The commit policy of this engine's steps (built, and the cost model measured, on
        first use)."""
        if self._policy is None:
            needs_cost = self.drafter.kind is not DrafterKind.NONE and self.policy_config.kind is not PolicyKind.STATIC
            self._policy = CommitPolicy(self.policy_config, self.cost_model() if needs_cost else None,
                                        self.acceptance_model, record=self.record_policy, rl=self.rl_model)
            self._policy.model_drafts = self.drafter.runs_model
        return self._policy

    @property
    def policy_trace(self) -> Trace:
        """The commit policy's logged decisions (with ``record_policy``)."""
        return self.policy.trace

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: list[int], params: GenerationParams, index: int = 0,
                    tenant: str | None = None, priority: int = 0) -> int:
        """Queue a request; it is admitted at a coming :meth:`step`. Returns its id.

        Args:
            prompt: the prompt's token ids.
            params: its settings (sampling, limits, stop conditions).
            index: the caller's label, reported in its events and results; it also keys the
                noise of ``coupled`` sampling, so equal (prompt, params, index) give equal output.
            tenant: who sent it (an API key or user); drafters that keep earlier answers
                per tenant draft its answer from that tenant's only.
            priority: waiting requests are admitted lowest value first (as vLLM's
                ``priority``), in arrival order within a value; running ones are not preempted.
        """
        check_request(prompt, params, self.target.max_positions, self.target.vocab_size)
        check_number("index", index, integer=True)
        check_routing(tenant, priority)
        if params.stop and not self._decodes:
            raise ConfigError("stop strings need the text of the answer: build the engine with decode= "
                              "(SoT.load does)")
        # the request's own copy: a caller that changes its list of stop strings afterwards
        # changes nothing here
        params = dataclasses.replace(params, stop=tuple(params.stop), eos_token_ids=tuple(params.eos_token_ids),
                                     sampling=dataclasses.replace(params.sampling,
                                                                  logit_bias=tuple(params.sampling.logit_bias)))
        _ = self.policy  # the cost model is measured before the first request's clock starts
        seq = LiveRequest(
            id=next(self._ids),
            prompt=list(prompt),
            params=params,
            result=SequenceResult(index=index, token_ids=[], prompt_tokens=len(prompt)),
            generator=None if params.sampling.greedy else sequence_generator(params.sampling.seed, index),
            arrived=time.perf_counter(),
            tenant=tenant,
            priority=priority,
        )
        if params.structured is not None:
            if self.grammars is None:
                raise ConfigError("structured output needs the tokenizer: build the engine with SoT.load")
            seq.matcher = self.grammars.matcher(params.structured)
        seq.result.request_id = seq.id
        at = len(self._waiting)  # behind every request of its priority or a lower value
        while at > 0 and self._waiting[at - 1].priority > priority:
            at -= 1
        self._waiting.insert(at, seq)
        return seq.id

    def _decode_for(self, seq: LiveRequest) -> Callable[[list[int]], str]:
        """The decode of ``seq``'s text: special tokens left out, or kept where it asks."""
        if not seq.params.skip_special_tokens and self.decode_special is not None:
            return self.decode_special
        return self.decode

    def abort(self, request_id: int) -> bool:
        """Cancel a request, waiting or running; its slot is free for the next step. Returns
        False when the engine does not hold it (finished, or never added)."""
        for i, seq in enumerate(self._waiting):
            if seq.id == request_id:
                del self._waiting[i]
                seq.finish("abort", self._decode_for(seq))
                return True
        for b, seq in enumerate(self._running):
            if seq.id == request_id:
                seq.finish("abort", self._decode_for(seq))
                self._leave(b)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def result(self, request_id: int) -> SequenceResult | None:
        """The (growing) result of a request the engine holds."""
        for seq in itertools.chain(self._running, self._waiting):
            if seq.id == request_id:
                return seq.result
        return None

    # ----------------------------------------------------------------- the step
    def step(self) -> list[TokenEvent]:
        """Admit waiting requests into free slots (their prompts are read and their first
        token committed), then run one speculative step over every live sequence. Returns the
        tokens committed, in order: a request admitted in this step may have two events, its
        first token's and its decoding step's."""
        for obs in self.observers:  # between steps (the last one's tokens are out): never inside one
            obs.between_steps()
        events = self._admit_waiting()
        self._release_finished()  # a request can end on its first token (EOS, or max_new_tokens 1)
        self.last_step = StepStats()
        if self._running:
            events += self._decode_step()
        self._release_finished()
        return events

    def _admit_waiting(self) -> list[TokenEvent]:
        room = len(self._waiting) if self.max_batch is None else self.max_batch - len(self._running)
        budget = self.prompt_budget
        count = 0
        while count < min(room, len(self._waiting)):  # the queue's head first, as far as the budget goes
            if budget is not None:
                seq = self._waiting[count]
                unread = len(seq.prompt) - self._read_so_far(seq)
                if unread > budget:
                    if budget > 0:  # read what the budget allows now, the rest on later steps
                        self._stage(seq, budget)
                    break
                budget -= unread
            count += 1
        admitted, self._waiting = self._waiting[:count], self._waiting[count:]
        if not admitted:
            return []
        # room for each prompt and its first steps, the queued ones' too (each growth copies the
        # whole cache); the cache grows as answers do (_decode_step)
        need = max(self._reach(s) for s in self._running + admitted + self._waiting)
        self._ensure_cache(len(self._running) + len(admitted), need + self._headroom())
        since = time.perf_counter()  # the clocks of a step's admissions start together
        # (an offline call wants throughput, not even steps: its prompts reach the drafter on
        # their first drafting step, so a batch that never drafts never reads them)
        read_now = not self._offline and self.policy.expects_drafting(len(self._running))
        return [self._admit(seq, since, read_now) for seq in admitted]

    def _read_so_far(self, seq: LiveRequest) -> int:
        """Prompt tokens of a waiting sequence already in a cache: read on earlier steps, or
        held by the prefix cache."""
        if seq.staged is not None:
            return seq.staged.length
        return self._lookup(seq).tokens

    def _lookup(self, seq: LiveRequest) -> PrefixHit:
        """The start of ``seq``'s prompt the prefix cache holds (none when the prompt's log
        probabilities are asked for: every row's logits are needed, and stored rows keep none)."""
        if self.prefix_cache is None or seq.params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        return self.prefix_cache.lookup(seq.prompt, seq.tenant, seq.params.cache_salt)

    def _prompt_rows(self, seq: LiveRequest, start: int) -> Callable[[torch.Tensor, int], None] | None:
        """With prompt log probabilities asked for, what receives the logits of a read of
        ``seq``'s prompt from token ``start`` (row ``j`` of a chunk at ``offset`` decides
        prompt token ``start + offset + j + 1``)."""
        k = seq.params.prompt_logprobs
        if k is None:
            return None
        if start == 0:
            seq.result.prompt_logprobs = [None]  # the first token has no distribution to come from

        def take(logits: torch.Tensor, offset: int) -> None:
            first = start + offset + 1
            tokens = seq.prompt[first:first + logits.shape[0]]
            if tokens:
                seq.result.prompt_logprobs.extend(token_logprobs(logits[:len(tokens)], tokens, k))
        return take

    def _stage(self, seq: LiveRequest, n: int) -> None:
        """Read the next ``n`` tokens of a waiting sequence's prompt into a cache of its own
        (made on its first call, from the prefix cache's rows); its clock starts then."""
        t0 = time.perf_counter()
        st = seq.staged
        if st is None:
            cache = self.target.new_cache(1, len(seq.prompt) + self.target.row_multiple)
            hit = self._lookup(seq)
            states = self._write_hit(cache, 0, hit)
            st = seq.staged = StagedPrompt(cache, [x for x in states if x is not None], hit.tokens)
            seq.result.cached_tokens = hit.tokens
            seq.started = t0
        out = self.target.prefill(st.cache, 0, torch.tensor(seq.prompt[st.length:st.length + n]), start=st.length,
                                  on_rows=self._prompt_rows(seq, st.length))
        if out.states is not None:
            st.states.append(out.states[0])
        st.length += n
        self.times.prefill += time.perf_counter() - t0

    def _ensure_cache(self, batch: int, capacity: int) -> None:
        """Room for ``batch`` sequences of ``capacity`` slots. A cache that must hold more
        sequences is made for every request already known (waiting ones too, up to
        ``max_batch``) at once: a batch admitted a sequence at a time otherwise copies its whole
        cache on each admission (13 copies, 1.5 s of a 12 s batch-16 run on 2 AVX2 cores)."""
        if self._cache is not None and self._cache.batch_size >= batch:
            self._cache = self._cache.grown_to(batch, capacity)
            return
        known = batch + len(self._waiting)  # (called after the admitted ones left the queue)
        slots = max(batch, known if self.max_batch is None else min(known, self.max_batch))
        if self._cache is None:
            self._cache = self.target.new_cache(slots, capacity)
            self.policy.flat = self.target.packs_flat(self._cache)
        else:
            self._cache = self._cache.grown_to(slots, capacity, self.max_batch)

    def _admit(self, seq: LiveRequest, since: float, read_now: bool) -> TokenEvent:
        """Prefill ``seq``'s prompt into the next free slot and commit its first token; with
        ``read_now`` the drafter reads the prompt now, else on the sequence's first drafting
        step. The sequence's clock runs from ``since``."""
        t0 = time.perf_counter()
        if seq.staged is None:  # (a prompt read over earlier steps started its clock then)
            seq.started = since
        b = len(self._running)
        self._running.append(seq)
        self.policy.add_sequence(seq.id, seq.params.sampling.temperature)
        out = self._read_prompt(seq, b)
        self._cache.set_length(b, len(seq.prompt))
        for obs in self.observers:
            obs.prefilled(seq, out.states[0] if out.states is not None else None, out.logits[0, -1])
        out = self._drafter_view(out)
        root = DraftTree.root_only(seq.prompt[-1])
        scores = AdjustedRows(out.logits[0, -1:], root, seq) if adjusts(seq.params) else out.logits[0, -1:]
        acc = accept_tree(seq.params.sampling, seq.result.index, seq.generator, root, scores, len(seq.prompt) - 1)
        if self.trace:
            seq.result.logit_trace.append(out.logits[0, -1].clone())
        if seq.params.logprobs is not None:
            seq.result.logprobs.extend(token_logprobs(out.logits[0, -1:], acc.tokens, seq.params.logprobs))
        now = time.perf_counter()
        seq.result.first_token_seconds = now - seq.started
        event = seq.commit(acc.tokens, now, self._decode_for(seq), counts_as_step=False)
        if seq.params.prompt_logprobs is not None:
            event = dataclasses.replace(event, prompt_logprobs=list(seq.result.prompt_logprobs))
        if self.record_steps:  # the first token, from the prompt's pass: step 0
            rec = build_record(0, len(seq.prompt) - 1, "prefill", root, root, acc.path, event.token_ids,
                               out.logits[0, -1:], None, None)
            rec.verify_seconds = round(now - t0, 6)
            seq.result.step_records.append(rec)
        if out.states is not None and not seq.done:
            if read_now:  # not in the running batch's next drafting step
                self.drafter.prepare([self._draft_input(seq, out.states[0])])
            else:
                seq.add_states(out.states[0])
        self.times.prefill += time.perf_counter() - t0
        return event

    def _read_prompt(self, seq: LiveRequest, b: int) -> ForwardOutput:
        """Read ``seq``'s prompt into cache slot ``b``, taking the rows the prefix cache holds
        for its start and storing the chunks it lacks. Returns the last row's logits
        ``[1, 1, V]`` and the whole prompt's states ``[1, T, S, D]`` (``None`` without state
        layers); ``seq.result.cached_tokens`` counts the prompt tokens reused."""
        prompt, store = seq.prompt, self.prefix_cache
        if seq.staged is not None:  # read over earlier steps: its rows move into slot b
            st, seq.staged = seq.staged, None
            keys, values = st.cache.read_span(0, 0, st.length)
            self._cache.write_span(b, 0, keys, values)
            start, states = st.length, list(st.states)
        else:
            hit = self._lookup(seq)
            start, states = hit.tokens, self._write_hit(self._cache, b, hit)
            seq.result.cached_tokens = hit.tokens
        self._cache.lengths[b] = start
        out = self.target.prefill(self._cache, b, torch.tensor(prompt[start:]), start=start,
                                  on_rows=self._prompt_rows(seq, start))
        whole = torch.cat([*states, out.states[0]]) if out.states is not None else None
        if store is not None and store.max_bytes > 0:
            if whole is not None:  # the answer's states join these (_decode_step)
                seq.history = [whole]
            self._store_prefix(seq, b, prompt, whole)
        return ForwardOutput(out.logits, whole[None] if whole is not None else None)

    def _write_hit(self, cache: KVCache, b: int, hit: PrefixHit) -> list[torch.Tensor | None]:
        """Write the rows a prefix-cache lookup found into ``cache`` slot ``b``; returns their
        states, a ``[n_j, S, D]`` piece (or ``None``) per chunk."""
        states: list[torch.Tensor | None] = []
        size = self.prefix_cache.chunk if self.prefix_cache is not None else 0
        for j, chunk in enumerate(hit.chunks):  # the last chunk may be taken in part
            n = min(len(chunk.tokens), hit.tokens - j * size)
            cache.write_span(b, j * size, chunk.keys[:, :, :n], chunk.values[:, :, :n])
            states.append(chunk.states[:n] if chunk.states is not None else None)
        return states

    def _store_prefix(self, seq: LiveRequest, b: int, tokens: list[int], states: torch.Tensor | None) -> None:
        """Put the chunks of ``tokens`` (a start of ``seq``'s context, every row in cache slot
        ``b``, with the target states ``states [T', S, D]``, ``T' >= len(tokens)``, where the
        target returns any) that the prefix cache lacks into it."""
        def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            keys, values = self._cache.read_span(b, start, end)
            return keys, values, states[start:end].clone() if states is not None else None

        self.prefix_cache.insert(tokens, seq.tenant, read, seq.params.cache_salt)

    def _reach(self, seq: LiveRequest) -> int:
        """The length ``seq`` may reach within the next :attr:`GROW_STEP` tokens (its prompt
        and ``max_new_tokens`` at most)."""
        return min(seq.length + self.GROW_STEP, len(seq.prompt) + seq.params.max_new_tokens)

    def _headroom(self) -> int:
        """Slots past a sequence's length that one step may write: its tree (scratch rows,
        rounded up) and the accepted path."""
        return round_up(self._max_tree, ROW_UNIT) + self.budget.max_depth + 1

    def _decode_step(self) -> list[TokenEvent]:
        """plan -> draft -> verify -> accept -> commit over the running sequences."""
        seqs = self._running
        longest = max(s.length for s in seqs)
        if longest + self._headroom() > self._cache.capacity:  # answers grew: room for GROW_STEP more
            self._ensure_cache(len(seqs), max(self._reach(s) for s in seqs) + self._headroom())
        t0 = time.perf_counter()
        passes = self.drafter.passes
        self.drafter.record_states = self.record_steps
        plan, trees = self._plan_and_draft(seqs)
        t1 = time.perf_counter()
        batch = pack_trees(trees, self._cache, self.target)
        t2 = time.perf_counter()
        # full: every state layer the target returned (observers, the prefix cache); out: the drafter's
        full = self.target.verify(self._cache.narrow(len(seqs)), batch.ids, batch.positions, batch.layout)
        self.target.synchronize()  # (on a GPU, the pass's time is its own, not the acceptance's)
        t3 = time.perf_counter()
        out = self._drafter_view(full)
        accepted = accept_all(seqs, batch.trees, out, self._cache, self.trace)
        head = full.head_seconds  # (the LM head of the rows the walks read, computed in accept_all)
        if full.states is not None and self.prefix_cache is not None:  # kept for the prefix cache
            if any(seq.history is not None for seq in seqs):
                picked = full.path_states([a.path if s.history is not None else [] for s, a in zip(seqs, accepted)])
                for seq, states in zip(seqs, picked):
                    if seq.history is not None:
                        seq.history.append(states)
        for obs in self.observers:
            obs.verified(seqs, batch.trees, full, [a.path for a in accepted], set(plan.drafting))
        self.policy.observe_step(plan, StepOutcome(
            trees={s.id: t for s, t in zip(seqs, batch.trees)},
            paths={s.id: a.path for s, a in zip(seqs, accepted)},
            draft_seconds=t1 - t0, draft_passes=self.drafter.passes - passes,
            verify_seconds=t3 - t2 + head, rows=batch.rows,
        ))
        events = self._commit_all(seqs, batch.trees, accepted)
        t4 = time.perf_counter()
        speculative = bool(plan.drafting) or any(t.size > 1 for t in batch.trees)
        self.policy.observe_wall(len(seqs), sum(len(a.tokens) for a in accepted), t4 - t0, speculative)
        self.times.draft += t1 - t0
        self.times.verify += t3 - t2 + head
        self.times.bookkeeping += (t2 - t1) + (t4 - t3 - head)
        if self.record_steps:
            record_step(seqs, batch, [a.path for a in accepted], events, out, self._proposed,
                        self.policy.expected_tokens, self.drafter.predicted_states,
                        (t1 - t0, t3 - t2 + head, (t2 - t1) + (t4 - t3 - head)))
            self._proposed = {}
        return events

    # ----------------------------------------------------------------- stages
    def _drafter_view(self, out: ForwardOutput) -> ForwardOutput:
        """``out`` with only the drafter's state layers (the target may return more)."""
        if self._pick is None or out.states is None:
            return out
        return out.with_states(out.states.index_select(-2, self._pick.to(out.states.device)))

    def _draft_input(self, seq: LiveRequest, states: torch.Tensor | None) -> DraftInput:
        return DraftInput(seq.id, seq.context, states, seq.result.index, seq.tenant,
                          DraftRules.of(seq.params.sampling, len(seq.prompt)), seq.params.prediction,
                          CoupledDraw.of(seq.params.sampling, seq.result.index, self.target.logits_width))

    def _plan_and_draft(self, seqs: list[LiveRequest]) -> tuple[StepPlan, list[DraftTree]]:
        """The policy plans the step, the drafter proposes, the policy selects what to
        verify. Returns the plan and ``[B]`` trees in slot order."""
        policy = self.policy
        given = {s.id: self._draft_input(s, None) for s in seqs}  # (free drafts read contexts only)
        # What the drafter offers for free (prompt-lookup matches) lets the policy keep its
        # model idle for a step; sequences that skip the model keep their states until it runs.
        # An offline call with nothing left to admit is a closed batch: its caller waits for the
        # last sequence, and no request takes a freed slot (the policy plans for the batch's end)
        left = ({s.id: s.params.max_new_tokens - len(s.result.token_ids) for s in seqs}
                if self._offline and not self._waiting else None)
        offers = ((policy.adaptive or policy.record) and not policy.holds_plain(len(seqs))
                  and policy.asks_offers(len(seqs), left is not None))
        budget = self.budget.for_batch(len(seqs))
        free = self.drafter.propose_free(list(given.values()), budget) if offers else None
        plan = policy.plan({s.id: len(s.result.token_ids) for s in seqs}, dict(zip(given, free or [])), budget,
                           left)
        proposed: dict[int, DraftTree] = {}
        if plan.drafting:
            by_id = {s.id: s for s in seqs}
            inputs = [self._draft_input(by_id[k], by_id[k].take_states()) for k in plan.drafting]
            drafted = self.drafter.propose(inputs, plan.budget)
            proposed = dict(zip(plan.drafting, drafted))
        chosen = policy.select(plan, proposed)
        # (plain decoding's "drafter" proposes root-only trees: its steps are plain steps)
        drafting = set(plan.drafting) if self.drafter.kind is not DrafterKind.NONE else set()
        if self.record_steps:
            shown = proposed if drafting else {}
            self._proposed = {k: step_mode(policy.seqs.get(k), k, plan, shown) for k in given}
        trees = []
        for seq in seqs:
            if seq.id not in drafting:
                seq.result.plain_steps += 1
            root = seq.root
            tree = chosen.get(seq.id) or DraftTree.root_only(root)
            if seq.matcher is not None and self.drafter.kind is not DrafterKind.NONE:
                forced = self._forced_chain(seq, tree)
                if forced is not tree and self.record_steps:  # a free draft, from the grammar
                    self._proposed[seq.id] = ("free", forced, False)
                tree = forced
            if self.target.max_positions is not None:  # no node past the model's last position
                room = max(self.target.max_positions - seq.length, 0)
                if tree.max_depth > room:
                    tree = tree.cut_at_depth(room)
            if tree.tokens[0] != root or tree.size > self._max_tree or tree.max_depth > self.budget.max_depth:
                raise RuntimeError(f"drafter {self.drafter.kind.value} broke the tree contract")
            trees.append(tree)
        return plan, trees

    def _forced_chain(self, seq: LiveRequest, tree: DraftTree) -> DraftTree:
        """With a grammar: the tokens it forces next (a JSON key, a closing quote), drafted as
        a chain in place of ``tree`` when its first token disagrees with them."""
        forced = seq.matcher.compute_ff_tokens()[: min(self.budget.max_depth, self._max_tree - 1)]
        if not forced:
            return tree
        kids = [i for i, p in enumerate(tree.parents) if p == 0]
        if any(tree.tokens[i] == forced[0] for i in kids):  # the drafter has it already
            return tree
        n = len(forced)
        return DraftTree([tree.tokens[0], *forced], [-1, *range(n)], list(range(n + 1)), [1.0] * (n + 1))

    def _commit_all(self, seqs: list[LiveRequest], trees: list[DraftTree],
                    accepted: list[Acceptance]) -> list[TokenEvent]:
        """Append each sequence's accepted tokens (up to its stop condition) and record the
        step's tree sizes and acceptance."""
        now = time.perf_counter()
        events = []
        for seq, tree, acc in zip(seqs, trees, accepted):
            seq.result.tree_sizes.append(tree.size)
            seq.result.fallbacks = self.policy.fallbacks(seq.id)
            record_depths(seq.result, tree, acc)
            events.append(seq.commit(acc.tokens, now, self._decode_for(seq), counts_as_step=True))
        self.last_step = StepStats.of([t.size for t in trees], [a.num_accepted for a in accepted],
                                      self.budget.max_depth)
        return events

    # ----------------------------------------------------------------- leaving
    def _release_finished(self) -> None:
        b = 0
        while b < len(self._running):
            if self._running[b].done:
                self._leave(b)  # the last sequence moves into slot b: look at b again
            else:
                b += 1

    def _leave(self, b: int) -> None:
        """Sequence in slot ``b`` leaves; the last running sequence takes its slot."""
        seq = self._running[b]
        last = len(self._running) - 1
        # the answer too, where its states were kept (or none are read): a chat's next turn starts with it
        store = self.prefix_cache
        if store is not None and store.max_bytes > 0 and (seq.history is not None or not self.target.state_layers):
            states = torch.cat(seq.history) if seq.history is not None else None
            self._store_prefix(seq, b, seq.context[: self._cache.lengths[b]], states)
        if b != last:
            self._cache.move(last, b)
            self._running[b] = self._running[last]
        self._running.pop()
        self._cache.lengths[last] = 0
        self.drafter.release(seq.id)
        self.drafter.remember(seq.prompt, seq.result.token_ids, seq.tenant)
        if seq.result.error is not None and seq.params.structured is not None:
            self.grammars.forget(seq.params.structured)  # (its compiled copy may be spent: the next compiles anew)
        for obs in self.observers:
            obs.finished(seq)
        self.policy.drop_sequence(seq.id)

    # ----------------------------------------------------------------- offline loops
    def generate(self, prompts: list[list[int]], params: GenerationParams,
                 batch_size: int | None = None) -> list[SequenceResult]:
        """Generate for every prompt (token ids); returns one result per prompt, in order.

        At most ``batch_size`` sequences (default: all) decode together. The batch is
        continuous: when a sequence finishes, the next waiting prompt takes its place at
        the next step, so a slow sequence never leaves the others' slots idle.
        """
        results: list[SequenceResult] = []
        for _ in self.stream(prompts, params, results, batch_size):
            pass
        return results

    def stream(
        self, prompts: list[list[int]], params: GenerationParams, results: list[SequenceResult] | None = None,
        batch_size: int | None = None, record_steps: bool | None = None,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`generate`, yielding tokens as they are committed; ``results``, when
        given, receives the per-sequence results (complete once the stream is exhausted).
        Prompt ``i`` is the request of index ``i``; ``record_steps``: as :meth:`offline_batch`."""
        with self.offline_batch(prompts, params, batch_size, record_steps) as out:
            if results is not None:
                results.extend(out)
            while self.has_unfinished():
                yield from self.step()

    @contextlib.contextmanager
    def offline_batch(self, prompts: list[list[int]], params: GenerationParams,
                      batch_size: int | None = None, record_steps: bool | None = None
                      ) -> Iterator[list[SequenceResult]]:
        """Queue ``prompts`` as one offline call (prompt ``i`` is the request of index ``i``,
        at most ``batch_size`` decoding together) and yield their results, which fill in as
        the caller runs :meth:`step` until :meth:`has_unfinished` is false. On leaving, the
        engine's batch limit is restored and anything left unfinished is aborted. The loop of
        :meth:`stream`; ``sot bench`` uses it to advance several engines a step at a time.

        One call holds the engine at a time: a call from another thread waits until this one
        ends (a stream: until it is read to its end or closed); a second call from the same
        thread, while its first is open, is refused. ``record_steps`` sets
        :attr:`record_steps` for this call only (``None``: as it is)."""
        check_prompts(prompts, params, self.target.max_positions, batch_size, self.target.vocab_size)
        busy = ConfigError("the engine has unfinished requests (from add_request, or a stream not read to its "
                           "end: close it); step them to the end first")
        if self._call_thread == threading.get_ident():
            raise busy
        with self._call_lock:
            if self.has_unfinished():
                raise busy
            saved, saved_record = self.max_batch, self.record_steps
            try:
                self._call_thread = threading.get_ident()
                self.max_batch = batch_size
                if record_steps is not None:
                    self.record_steps = record_steps
                self.drafter.reset(min(len(prompts), batch_size or len(prompts)))
                self.policy.trace = Trace()  # a recording run logs this call's decisions
                self._offline = True
                ids = [self.add_request(p, params, index=i) for i, p in enumerate(prompts)]
                yield [self.result(r) for r in ids]
            finally:
                try:
                    self.max_batch, self.record_steps = saved, saved_record
                    self._offline = False
                    for r in list(self._waiting) + list(self._running):  # a call left early
                        self.abort(r.id)
                finally:
                    self._call_thread = None
