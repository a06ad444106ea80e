"""The decoding loop: draft -> verify -> accept -> commit, for a batch of sequences.

Every sequence keeps its own cache length, tree, acceptance and stopping state. Finished
sequences stay in the batch with a root-only tree whose result is ignored, so the rows of
the others are unaffected (every row is computed independently of its neighbours).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from sot.acceptance import Acceptance, accept_coupled, accept_greedy, accept_rejection
from sot.attention import MAX_TREE_DEPTH, build_tree_layout
from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.errors import ConfigError, PromptTooLongError
from sot.models.adapter import TargetModel
from sot.models.rows import ROW_UNIT
from sot.policy import AcceptanceModel, CommitPolicy, CostModel, PolicyConfig, PolicyKind
from sot.sampling import SamplingMode, SamplingParams, sequence_generator
from sot.tree import DraftTree, ancestor_table


@dataclass(frozen=True)
class GenerationParams:
    """Per-call generation settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens per sequence.
        sampling: temperature / top-k / top-p / seed / mode (temperature 0 is greedy).
        stop: strings that end a sequence when they appear in its text.
        eos_token_ids: tokens that end a sequence (included in ``token_ids``).
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SequenceResult:
    """The output of one sequence, with its statistics.

    ``accept_lengths[i]`` is the number of tokens committed at verify step ``i``
    (accepted drafted tokens plus the bonus token); its mean is tau.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str = "length"
    accept_lengths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_token_seconds: float = 0.0
    #: per verify step: nodes verified, root included (1 = a plain step)
    tree_sizes: list[int] = field(default_factory=list)
    #: steps on which the commit policy kept the drafter's model idle (warm-up or fallback; they
    #: verify the drafter's free trees, if any, else decode plainly), and fallbacks taken
    plain_steps: int = 0
    fallbacks: int = 0
    #: with ``Engine(trace=True)``: the logits row ``[V]`` that decided each committed token.
    logit_trace: list[torch.Tensor] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PhaseTimes:
    """Wall time spent in each phase of the loop, in seconds."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    bookkeeping: float = 0.0


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed to one sequence at one step (for streaming)."""

    sequence: int
    token_ids: list[int]
    finished: bool


@dataclass
class _Seq:
    prompt: list[int]
    result: SequenceResult
    generator: torch.Generator | None
    #: ``[n, S, D]`` target states of the rows committed since the drafter last saw this sequence
    states: torch.Tensor | None = None
    done: bool = False
    start: float = 0.0  # when the sequence entered the batch (its prefill began)


def _fitting_acceptance_model(config: PolicyConfig, drafter: Drafter, target: TargetModel) -> AcceptanceModel | None:
    """The learned policy's model when one is available for this target and drafter."""
    from sot.policy import load_acceptance_model

    if drafter.kind is not DrafterKind.STATE:
        return None
    try:
        return load_acceptance_model(config.model_path, target.model)
    except ConfigError:
        if config.model_path:  # asked for by name: its errors are the user's to see
            raise
        return None


class Engine:
    """Tree-speculative decoding over a :class:`TargetModel`.

    Args:
        target: the wrapped target model.
        drafter: proposes trees; :class:`sot.drafters.NoDrafter` gives plain decoding.
        budget: node and depth limits of each tree.
        decode: ``token_ids -> text`` used for stop strings and results.
        trace: keep the logits row behind every committed token (for exactness checks).
        policy: the commit policy (default: heuristic); ignored for plain decoding. With
            ``static``, a state drafter grows a fixed beam of its ``top_k`` nodes per depth to
            ``budget.max_depth`` (``budget.max_nodes`` is raised to fit it).
        acceptance_model: the model of the ``learned`` policy (default: loaded from
            ``policy.model_path``, or the one shipped for the default model).
        record_policy: verify every tree whole and log the commit policy's features and the
            outcome of every node in ``self.policy_trace`` (training data of ``learned``).
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
    ) -> None:
        if budget.max_nodes < 1 or budget.max_depth < 0:
            raise ConfigError("tree budget needs max_nodes >= 1 and max_depth >= 0")
        if budget.max_depth > MAX_TREE_DEPTH:
            raise ConfigError(f"max depth {budget.max_depth} exceeds the supported {MAX_TREE_DEPTH}")
        missing = set(drafter.state_layers) - set(target.state_layers)
        if missing:
            raise ConfigError(f"the drafter needs target states of layers {sorted(missing)}")
        self.policy_config = policy or PolicyConfig()
        if self.policy_config.kind is PolicyKind.AUTO:
            acceptance_model = acceptance_model or _fitting_acceptance_model(self.policy_config, drafter, target)
            kind = PolicyKind.LEARNED if acceptance_model is not None else PolicyKind.HEURISTIC
            self.policy_config = dataclasses.replace(self.policy_config, kind=kind)
        if self.policy_config.kind is PolicyKind.STATIC and drafter.static_width > 0:
            width = drafter.static_width
            budget = TreeBudget(max_nodes=1 + width * budget.max_depth, max_depth=budget.max_depth, width=width)
        self.target = target
        self.drafter = drafter
        self.budget = budget
        self.decode = decode or (lambda ids: "")
        self.times = PhaseTimes()
        self.trace = trace
        self.record_policy = record_policy
        self.policy_trace = None
        self.acceptance_model = acceptance_model
        if (self.policy_config.kind is PolicyKind.LEARNED and acceptance_model is None and not record_policy
                and drafter.kind is not DrafterKind.NONE):
            from sot.policy import load_acceptance_model

            self.acceptance_model = load_acceptance_model(self.policy_config.model_path, target.model)

    def cost_model(self) -> CostModel:
        """Verify time by row count on this machine, measured once per target and tree size."""
        rows = max(64, self.budget.max_nodes)  # batches are costed by their total rows
        key = ("sot_cost_model", rows)
        cached = getattr(self.target, "_sot_costs", {})
        if key not in cached:
            cached[key] = CostModel.measure(self.target, rows)
            self.target._sot_costs = cached
        return cached[key]

    # ----------------------------------------------------------------- public API
    def generate(self, prompts: list[list[int]], params: GenerationParams,
                 batch_size: int | None = None) -> list[SequenceResult]:
        """Generate for every prompt (token ids); returns one result per prompt, in order.

        At most ``batch_size`` sequences (default: all) decode together. The batch is
        continuous: when a sequence finishes, the next waiting prompt takes its place at
        the next step, so a slow sequence never leaves the others' slots idle.
        """
        results: list[SequenceResult] = []
        for event in self._run(prompts, params, results, batch_size):
            del event
        return results

    def stream(
        self, prompts: list[list[int]], params: GenerationParams, results: list[SequenceResult] | None = None,
        batch_size: int | None = None,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`generate`, yielding tokens as they are committed; ``results``, when
        given, receives the per-sequence results (complete once the stream is exhausted)."""
        yield from self._run(prompts, params, [] if results is None else results, batch_size)

    # ----------------------------------------------------------------- the loop
    def _check(self, prompts: list[list[int]], params: GenerationParams) -> None:
        if not prompts:
            raise ConfigError("no prompts given")
        if params.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        limit = self.target.max_positions
        for i, p in enumerate(prompts):
            if not p:
                raise ConfigError(f"prompt {i} is empty")
            if limit and len(p) + params.max_new_tokens > limit:
                raise PromptTooLongError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={params.max_new_tokens} it exceeds "
                    f"the model's context of {limit} tokens"
                )

    def _run(
        self, prompts: list[list[int]], params: GenerationParams, results: list[SequenceResult],
        batch_size: int | None = None,
    ) -> Iterator[TokenEvent]:
        self._check(prompts, params)
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        sp = params.sampling
        seqs = [
            _Seq(
                prompt=list(p),
                result=SequenceResult(index=i, token_ids=[]),
                generator=sequence_generator(sp.seed, i) if not sp.greedy else None,
            )
            for i, p in enumerate(prompts)
        ]
        results.extend(s.result for s in seqs)
        width = min(len(seqs), batch_size or len(seqs))
        self.drafter.reset(width)
        needs_cost = self.drafter.kind is not DrafterKind.NONE and self.policy_config.kind is not PolicyKind.STATIC
        self._policy = CommitPolicy(self.policy_config, self.cost_model() if needs_cost else None,
                                    self.acceptance_model, record=self.record_policy)
        self._policy.reset(width, 0.0 if sp.greedy else sp.temperature)
        self.policy_trace = self._policy.trace
        start = time.perf_counter()  # after the one-time cost model: the clocks time generation
        # Committed tokens, the accepted rows of a last step that overshoots max_new_tokens
        # (kept in the cache of a finished sequence), and the scratch rows of one pass.
        scratch = -(-self.budget.max_nodes // ROW_UNIT) * ROW_UNIT
        capacity = max(len(p) for p in prompts) + params.max_new_tokens + self.budget.max_depth + scratch
        cache = self.target.new_cache(width, capacity)

        slots = seqs[:width]  # slot b of the cache, the drafter and the policy holds slots[b]
        waiting = iter(seqs[width:])
        for b, seq in enumerate(slots):  # the first batch's clocks all start with the call
            yield from self._admit(b, seq, cache, params, start)
        while True:
            for b in range(width):
                while slots[b].done:  # a finished sequence's slot goes to the next prompt
                    seq = next(waiting, None)
                    if seq is None:
                        break
                    slots[b] = seq
                    self.drafter.reset_sequence(b)
                    self._policy.reset_sequence(b)
                    yield from self._admit(b, seq, cache, params, time.perf_counter())
            if all(s.done for s in slots):
                break
            yield from self._step(slots, cache, params)
        for seq in seqs:
            seq.result.text = self.decode(seq.result.token_ids)

    def _admit(self, b: int, seq: _Seq, cache, params: GenerationParams, since: float) -> Iterator[TokenEvent]:
        """Prefill ``seq``'s prompt into cache slot ``b`` and commit its first token; the
        sequence's clock (first-token time, seconds) runs from ``since``."""
        seq.start = since
        t0 = time.perf_counter()
        out = self.target.prefill(cache, b, torch.tensor(seq.prompt))
        cache.set_length(b, len(seq.prompt))
        root = DraftTree([seq.prompt[-1]], [-1], [0])
        acc = self._accept(root, out.logits[0, -1:], params.sampling, seq.result.index, len(seq.prompt) - 1,
                           seq.generator)
        seq.states = out.states[0] if out.states is not None else None
        if self.trace:
            seq.result.logit_trace.append(out.logits[0, -1].clone())
        now = time.perf_counter()
        seq.result.first_token_seconds = now - seq.start
        yield from self._commit(seq, acc.tokens, params, now)
        self.times.prefill += time.perf_counter() - t0

    def _step(self, seqs: list[_Seq], cache, params: GenerationParams) -> Iterator[TokenEvent]:
        sp = params.sampling
        t0 = time.perf_counter()
        active = [b for b, s in enumerate(seqs) if not s.done]
        policy = self._policy
        drafting = [b for b in active if policy.wants_draft(b, len(seqs[b].result.token_ids))]
        plain = [b for b in active if b not in drafting]

        # each sequence's context is built once per step, for the free drafts and the drafter
        given = {b: DraftInput(b, seqs[b].prompt + seqs[b].result.token_ids, seqs[b].states) for b in active}

        def inputs(group: list[int]) -> list[DraftInput]:
            return [given[b] for b in group]

        # What the drafter offers for free (prompt-lookup matches): sequences whose model is
        # idle verify it, and a drafting sequence takes it instead when it promises more than
        # drafting has been yielding. Sequences that skip the drafter's model keep their
        # states until it next runs.
        free = (self.drafter.propose_free(inputs(active), self.budget) if active and policy.adaptive else None) or []
        free_trees = dict(zip(active, free))
        if free_trees:
            taken = [b for b in drafting if policy.prefers_free(b, free_trees[b])]
            drafting = [b for b in drafting if b not in taken]
            plain += taken
        t_draft = time.perf_counter()
        budget = policy.draft_budget(self.budget, drafting, len(seqs))
        passes = self.drafter.passes
        proposed = dict(zip(drafting, self.drafter.propose(inputs(drafting), budget))) if drafting else {}
        if drafting:
            policy.observe_draft(time.perf_counter() - t_draft, self.drafter.passes - passes)
        for b in drafting:
            seqs[b].states = None
        proposed.update((b, free_trees[b]) for b in plain if b in free_trees)
        proposed = policy.choose_batch(proposed, len(seqs), len(active), calibrated=frozenset(plain))
        for b in plain:
            seqs[b].result.plain_steps += 1
        t1 = time.perf_counter()
        draft_share = (t1 - t0) / max(1, len(drafting))

        trees: list[DraftTree] = []
        for b, seq in enumerate(seqs):
            root = (seq.result.token_ids or seq.prompt)[-1]
            tree = proposed.get(b) or DraftTree([root], [-1], [0])
            if tree.tokens[0] != root or tree.size > self.budget.max_nodes or tree.max_depth > self.budget.max_depth:
                raise RuntimeError(f"drafter {self.drafter.kind.value} broke the tree contract")
            trees.append(tree)
        unit = self.target.row_multiple
        rows = -(-max(t.size for t in trees) // unit) * unit
        width = max(t.max_depth for t in trees) + 1
        ids = torch.zeros(len(seqs), rows, dtype=torch.long)
        pos = torch.zeros(len(seqs), rows, dtype=torch.long)
        ancestors = []
        for b, tree in enumerate(trees):
            length = cache.lengths[b]
            ids[b] = tree.tokens[0]
            ids[b, : tree.size] = torch.tensor(tree.tokens)
            pos[b] = length
            pos[b, : tree.size] = torch.tensor(tree.depths) + length
            ancestors.append(ancestor_table(tree, width))
        layout = build_tree_layout(cache.lengths, ancestors, rows, cache)
        t2 = time.perf_counter()
        out = self.target.verify(cache, ids, pos, layout)
        t3 = time.perf_counter()

        keep: list[list[int]] = []
        commits: list[tuple[int, Acceptance]] = []
        policy_verify = policy.cost.verify if policy.cost is not None else (lambda rows: 0.0)
        for b, (seq, tree) in enumerate(zip(seqs, trees)):
            if seq.done:
                keep.append([])
                continue
            length = cache.lengths[b]
            acc = self._accept(tree, out.logits[b], sp, seq.result.index, length, seq.generator)
            keep.append([length + i for i in acc.path])
            commits.append((b, acc))
            seq.result.tree_sizes.append(tree.size)
            if b in drafting:
                policy.observe(b, tree, acc.path, draft_share + policy_verify(tree.size))
                seq.result.fallbacks = policy.seqs[b].fallbacks
            elif b in free_trees:
                policy.observe_free(b, tree, acc.path)
            if out.states is not None:
                new = out.states[b, acc.path]
                seq.states = new if seq.states is None else torch.cat((seq.states, new))
            if self.trace:
                seq.result.logit_trace.extend(out.logits[b, i].clone() for i in acc.path)
            self._record_depths(seq.result, tree, acc)
        cache.keep_rows(keep)
        now = time.perf_counter()
        for b, acc in commits:
            yield from self._commit(seqs[b], acc.tokens, params, now, step=True)
        t4 = time.perf_counter()
        self.times.draft += t1 - t0
        self.times.verify += t3 - t2
        self.times.bookkeeping += (t2 - t1) + (t4 - t3)

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _record_depths(result: SequenceResult, tree: DraftTree, acc: Acceptance) -> None:
        """Per draft depth d (1-based): was a node at depth d offered, and accepted?"""
        depth = tree.max_depth
        while len(result.depth_attempts) < depth:
            result.depth_attempts.append(0)
            result.depth_accepts.append(0)
        for d in range(1, depth + 1):
            # Depth d is attempted only if the path reached depth d - 1.
            if acc.num_accepted >= d - 1:
                result.depth_attempts[d - 1] += 1
                if acc.num_accepted >= d:
                    result.depth_accepts[d - 1] += 1

    @staticmethod
    def _accept(
        tree: DraftTree,
        logits: torch.Tensor,
        sp: SamplingParams,
        sequence: int,
        root_position: int,
        generator: torch.Generator | None,
    ) -> Acceptance:
        if sp.greedy:
            return accept_greedy(tree, logits)
        if sp.mode is SamplingMode.COUPLED:
            return accept_coupled(tree, logits, sp, sequence, root_position)
        assert generator is not None
        return accept_rejection(tree, logits, sp, generator)

    def _commit(
        self, seq: _Seq, tokens: list[int], params: GenerationParams, now: float, step: bool = False
    ) -> Iterator[TokenEvent]:
        """Append tokens up to a stop condition; ``step`` records the count as an accepted length."""
        res = seq.result
        taken: list[int] = []
        for tok in tokens:
            taken.append(tok)
            res.token_ids.append(tok)
            if tok in params.eos_token_ids:
                res.finish_reason = "eos"
                seq.done = True
                break
            if len(res.token_ids) >= params.max_new_tokens:
                res.finish_reason = "length"
                seq.done = True
                break
        if step:
            res.accept_lengths.append(len(taken))
        if params.stop and not seq.done:
            text = self.decode(res.token_ids)
            if any(s in text for s in params.stop):
                res.finish_reason = "stop"
                seq.done = True
        res.seconds = now - seq.start
        yield TokenEvent(sequence=res.index, token_ids=taken, finished=seq.done)
