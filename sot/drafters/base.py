"""The drafter interface shared by every way of proposing draft trees."""
from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

    from sot.drafters.suffix import SuffixStores
    from sot.sampling import CoupledDraw

from sot.errors import ConfigError
from sot.requests import check_number
from sot.tree import DraftTree


class DrafterKind(str, enum.Enum):
    """Which drafter proposes trees."""

    NONE = "none"  # plain decoding through the engine
    PLD = "pld"  # prompt lookup: n-gram matches in the context
    SUFFIX = "suffix"  # suffix trees over the context and earlier answers, with prompt lookup
    STATE = "state"  # the learned state predictor


#: children per expanded node of a state-predictor tree (``--draft-top-k``; the width of
#: ``--policy static`` trees): the one place this default lives
DRAFT_TOP_K = 8


@dataclass(frozen=True)
class TreeBudget:
    """Limits on one sequence's tree in a step.

    ``max_nodes`` (root included) and ``max_depth`` bound every tree the step verifies for the
    sequence, whatever proposed it. The state predictor's own tree is bounded more tightly,
    by ``predictor_nodes`` and ``predictor_depth`` (each of its levels is a predictor pass);
    the free drafts (prompt lookup, suffix trees), which cost no model pass, may reach
    ``max_depth`` on their own or merged into the predictor's tree while one sequence decodes
    (:meth:`for_batch`), and the commit policy prunes whatever does not pay for its verify rows. ``width > 0`` asks for a fixed shape
    instead of a confidence-grown tree: the best ``width`` nodes at every depth down to
    ``max_depth`` (drafters that only make chains ignore it). ``min_confidence``, when set,
    replaces the drafter's own floor: nodes whose cumulative draft probability is below it
    are not expanded."""

    max_nodes: int = 32
    max_depth: int = 24
    width: int = 0
    min_confidence: float | None = None
    predictor_nodes: int = 16
    predictor_depth: int = 8

    def for_batch(self, batch: int) -> "TreeBudget":
        """The limits of a step in which ``batch`` sequences decode. One sequence may take the
        whole budget. In a batch every tree keeps to the predictor's limits: there the verify
        pass is compute-bound, rows cost in proportion, and a closed batch lasts as long as
        its slowest sequence; deeper free drafts ran at 0.93-0.97x the smaller budget with
        ``auto`` at batch 4 and 16 in three runs, within this machine's noise for batches but
        never above it (``docs/NOTEBOOK.md``, *Free drafts past the predictor's depth*)."""
        if batch <= 1 or self.width > 0:
            return self
        return dataclasses.replace(self, max_nodes=self.grown_nodes, max_depth=self.grown_depth)

    @property
    def grown_nodes(self) -> int:
        """Nodes of the predictor's own tree at most, root included."""
        return min(self.predictor_nodes, self.max_nodes)

    @property
    def grown_depth(self) -> int:
        """Levels of the predictor's own tree at most."""
        return min(self.predictor_depth, self.max_depth)

    def check(self, max_depth: int, max_nodes: int | None = None) -> None:
        """Raise :class:`ConfigError` unless this budget is valid with trees of at most
        ``max_depth`` levels and ``max_nodes`` nodes."""
        check_number("max_nodes", self.max_nodes, integer=True, low=1, high=max_nodes)
        check_number("max_depth", self.max_depth, integer=True, low=0)
        check_number("predictor_nodes", self.predictor_nodes, integer=True, low=1, high=max_nodes)
        check_number("predictor_depth", self.predictor_depth, integer=True, low=0)
        if self.max_depth > max_depth:
            raise ConfigError(f"max depth {self.max_depth} exceeds the supported {max_depth}")


@dataclass(frozen=True)
class DraftRules:
    """The logit rules of a request that a drafter can follow: penalties and bias (as
    :mod:`sot.logit_rules` applies them to the verified rows). A drafter that follows them
    proposes what the adjusted target would choose; they change only the drafts, never what is
    verified or committed.

    Attributes:
        prompt_len: the context's tokens before the answer (frequency and presence penalties
            count the answer only; the repetition penalty counts both).
    """

    prompt_len: int
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, sampling: object, prompt_len: int) -> "DraftRules | None":
        """The rules of a request's sampling settings (a :class:`~sot.sampling.SamplingParams`);
        ``None`` when it asks for none of them."""
        rep = sampling.repetition_penalty
        freq, pres, bias = sampling.frequency_penalty, sampling.presence_penalty, tuple(sampling.logit_bias)
        if rep == 1.0 and not freq and not pres and not bias:
            return None
        return cls(prompt_len, rep, freq, pres, bias)


@dataclass
class DraftInput:
    """What a drafter sees of one sequence at one step.

    Attributes:
        sequence: the sequence's key, unique among the sequences the engine holds (its
            request id); :meth:`Drafter.release` forgets it when the sequence leaves.
        index: the caller's label of the sequence (its prompt's index in a
            :meth:`~sot.engine.Engine.generate` call; 0 for a served request).
        context: every token so far (prompt, then generated); the last one is the root.
        states: ``[n, S, D]`` target hidden states of the rows committed since the drafter
            last saw this sequence (``S`` layers as listed by :attr:`Drafter.state_layers`;
            they end at the position before the root), or ``None``.
        tenant: who sent the request (an API key or user), for drafters that keep what
            earlier requests generated apart per tenant; ``None``: anonymous.
        rules: the request's penalties and bias, for drafters that follow them; ``None``:
            it asks for none.
        prediction: token ids the request expects the answer to repeat (Predicted Outputs),
            copied from as the context is; empty: none.
        draw: how the sequence's tokens are drawn where coupled sampling draws them (its
            noise at every position ahead is known), for drafters that draft with that
            noise; ``None``: greedy decoding or rejection sampling.
    """

    sequence: int
    context: list[int]
    states: torch.Tensor | None = None
    index: int = 0
    tenant: str | None = None
    rules: DraftRules | None = None
    prediction: Sequence[int] = ()
    draw: CoupledDraw | None = None


class Drafter(ABC):
    """Proposes one draft tree per sequence per step.

    A drafter keeps per-sequence memory keyed by :attr:`DraftInput.sequence`, which
    :meth:`release` and :meth:`reset` drop; it never touches the target model or the KV cache.
    """

    kind: DrafterKind
    #: indices into the target's ``hidden_states`` (0 = embeddings) this drafter needs.
    state_layers: tuple[int, ...] = ()
    #: nodes per depth of the fixed-shape trees of the ``static`` policy (0: the drafter has
    #: no fixed shape and its trees are verified as proposed)
    static_width: int = 0
    #: model passes run by :meth:`propose` so far (drafters without a model leave it at 0);
    #: the commit policy times drafting per pass from it
    passes: int = 0
    #: whether :meth:`propose` costs a model pass. A drafter whose trees cost none (prompt
    #: lookup, suffix trees) sets it False and gives the same trees from :meth:`propose_free`:
    #: an adaptive policy then takes them as free drafts every step, priced by their own
    #: calibrated ``draft_probs``, and never sends a sequence to fallback for them (falling
    #: back would save no model pass, and while it lasts nothing is learned)
    runs_model: bool = True
    #: keep the predicted state of each proposed node for :meth:`predicted_states` (set by
    #: the engine while it records step traces)
    record_states: bool = False

    @property
    def suffix_stores(self) -> "SuffixStores | None":
        """The stores of earlier answers this drafter drafts from (``None``: it keeps none)."""
        return None

    def reset(self, batch_size: int = 0) -> None:
        """Forget all sequences (``batch_size`` is a hint of how many come next)."""

    def release(self, sequence: int) -> None:
        """Forget sequence ``sequence`` only: it finished or was aborted."""

    def remember(self, prompt: list[int], answer: list[int], tenant: str | None = None) -> None:
        """A request ended with ``answer`` to ``prompt``: drafters that draft from earlier
        answers (suffix trees) keep it."""

    def prepare(self, inputs: list[DraftInput]) -> None:
        """Read the states of newly admitted sequences (their prompts) now, so that the cost
        is paid at admission and not by the next drafting step of the whole batch."""

    def predicted_states(self, sequence: int) -> dict[tuple[int, ...], torch.Tensor] | None:
        """With :attr:`record_states`: the state ``[D]`` this drafter predicted for each node of
        the last tree it proposed for ``sequence``, keyed by the node's token path from the
        root's child down (``()``: the root); ``None`` for drafters that predict no states."""
        return None

    @abstractmethod
    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        """One tree per input, rooted at ``input.context[-1]``."""

    def propose_free(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree] | None:
        """Trees that cost no model pass (e.g. prompt-lookup matches), for the steps on which
        the commit policy keeps the drafter's model idle (warm-up, fallback). Their
        ``draft_probs`` estimate each node's acceptance as they stand (the policy does not
        recalibrate them). ``None`` when the drafter has no such trees: those steps are plain.
        ``input.states`` is left for the next :meth:`propose`."""
        return None


class NoDrafter(Drafter):
    """Proposes nothing: every step verifies the root alone, which is plain decoding."""

    kind = DrafterKind.NONE

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        return [DraftTree.root_only(x.context[-1]) for x in inputs]
