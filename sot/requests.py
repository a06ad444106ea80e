"""What a request asks for and what it gets back: generation settings, results, streamed
token events, and the engine's step statistics."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Callable

import torch

from sot.cache import KVCache
from sot.detokenize import IncrementalText
from sot.errors import ConfigError, PromptTooLongError, SoTError
from sot.sampling import MAX_TOP_LOGPROBS, SamplingMode, SamplingParams, TokenLogprob
from sot.structured import grammar_error
from sot.trace import StepRecord

if TYPE_CHECKING:
    from sot.structured import StructuredOutput


@dataclass(frozen=True)
class GenerationParams:
    """Per-request generation settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens.
        sampling: temperature / top-k / top-p / seed / mode (temperature 0 is greedy).
        stop: strings that end a sequence when they appear in its text.
        eos_token_ids: tokens that end a sequence (included in ``token_ids``).
        logprobs: ``None``: none; ``k >= 0``: each generated token's log probability under
            the model, with the ``k`` most likely tokens at its position
            (:class:`~sot.sampling.TokenLogprob`).
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    #: ``None``: none; ``k >= 0``: the log probability of each prompt token after the first,
    #: with ``k`` alternatives (the prompt is then read whole, not taken from the prefix cache)
    prompt_logprobs: int | None = None
    #: the end-of-sequence tokens are not chosen before this many tokens are generated
    min_tokens: int = 0
    #: the form the answer must take (a JSON schema, a regex, ...; :mod:`sot.structured`)
    structured: StructuredOutput | None = None
    #: the answer's text (and the text stop strings are found in) leaves special tokens out
    skip_special_tokens: bool = True
    #: the prefix cache shares stored prompt chunks only between requests of the same salt
    #: (vLLM's ``cache_salt``): a user's own salt keeps others from learning, by the prompt
    #: tokens reused or the time to the first token, whether their prompt began like this one
    cache_salt: str | None = None
    #: token ids the answer is expected to repeat in large part (OpenAI's Predicted Outputs: a
    #: file the request asks to edit); the drafters copy from them as from the context, so
    #: they change the speed, never the answer
    prediction: tuple[int, ...] = ()


@dataclass
class SequenceResult:
    """The output of one request, with its statistics.

    ``accept_lengths[i]`` is the number of tokens committed at verify step ``i``
    (accepted drafted tokens plus the bonus token); its mean is tau.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    #: ``length``, ``eos``, ``stop``, ``abort`` or ``grammar`` (the structured output's grammar
    #: allowed no token of the model's vocabulary: the answer is cut short of its form)
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
    #: the request's id in its engine
    request_id: int = -1
    prompt_tokens: int = 0
    #: prompt tokens whose KV rows came from the engine's prefix cache (not read again)
    cached_tokens: int = 0
    #: with ``GenerationParams.logprobs``: one per token of ``token_ids``
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: with ``GenerationParams.prompt_logprobs``: one per prompt token (``None`` for the first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    #: with ``Engine(record_steps=True)``: one record per verify step (:mod:`sot.trace`)
    step_records: list[StepRecord] = field(default_factory=list)
    #: why a ``grammar`` finish was not the grammar's dead end but its engine's failure (a
    #: pattern past the engine's size limits), in the engine's words; else ``None``
    error: str | None = None

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
    """Tokens committed to one request at one step (for streaming).

    Attributes:
        sequence: the request's index (its prompt's position in a :meth:`Engine.generate`
            call, or the index given to :meth:`Engine.add_request`).
        token_ids: the tokens committed.
        finished: the request is complete; ``finish_reason`` says why.
        request_id: the request's id.
        finish_reason: ``length``, ``eos``, ``stop`` or ``grammar`` once finished, else ``None``
            (:meth:`Engine.abort` ends a request without an event).
    """

    sequence: int
    token_ids: list[int]
    finished: bool
    request_id: int = -1
    finish_reason: str | None = None
    #: the request's result, on its last event (the engine forgets the request after it)
    result: SequenceResult | None = field(default=None, compare=False, repr=False)
    #: with ``GenerationParams.logprobs``: one per token of ``token_ids``
    logprobs: list[TokenLogprob] = field(default_factory=list, compare=False, repr=False)
    #: with ``GenerationParams.prompt_logprobs``, on the request's first event: one per prompt
    #: token (``None`` for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StepStats:
    """What the last :meth:`Engine.step`'s verify pass did: ``batch`` sequences in it,
    ``drafted[b]`` nodes verified beyond sequence ``b``'s root, and ``accepted_per_pos[d]``
    sequences whose accepted path reached draft position ``d``."""

    batch: int = 0
    drafted: tuple[int, ...] = ()
    accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def of(cls, sizes: list[int], accepted: list[int], max_depth: int) -> "StepStats":
        """The statistics of a step whose trees had ``sizes`` nodes and whose sequences
        accepted ``accepted`` drafted tokens each."""
        per_pos = [0] * (max_depth + 1)
        for n in accepted:
            for d in range(n):
                per_pos[d] += 1
        return cls(batch=len(sizes), drafted=tuple(s - 1 for s in sizes), accepted_per_pos=tuple(per_pos))


def check_prompts(prompts: list[list[int]], params: GenerationParams, max_positions: int | None,
                  batch_size: int | None, vocab_size: int | None = None) -> None:
    """Raise a :class:`~sot.errors.SoTError` naming the first prompt of an offline call that
    cannot run (or a bad ``batch_size``)."""
    if not prompts:
        raise ConfigError("no prompts given")
    if batch_size is not None:
        check_number("batch_size", batch_size, integer=True, low=1)
    for i, p in enumerate(prompts):
        try:
            check_request(p, params, max_positions, vocab_size)
        except SoTError as exc:
            raise type(exc)(f"prompt {i}: {exc}") from None


def check_request(prompt: list[int], params: GenerationParams, max_positions: int | None,
                  vocab_size: int | None = None) -> None:
    """Raise a :class:`~sot.errors.SoTError` naming what is wrong with one request."""
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, Integral) and not isinstance(t, bool)
                                                         for t in prompt):
        raise ConfigError("the prompt must be a list of token ids (encode text with SoT.encode)")
    if not prompt:
        raise ConfigError("the prompt is empty")
    if vocab_size and not all(0 <= t < vocab_size for t in prompt):
        raise ConfigError(f"the prompt's token ids must be in [0, {vocab_size})")
    check_params(params, vocab_size)
    if max_positions and len(params.prediction) > max_positions:  # (no answer could repeat more)
        raise ConfigError(f"the prediction has {len(params.prediction)} tokens, more than the model's context of "
                          f"{max_positions}")
    if max_positions and len(prompt) + params.max_new_tokens > max_positions:
        raise PromptTooLongError(
            f"the prompt has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} it exceeds "
            f"the model's context of {max_positions} tokens"
        )


def check_routing(tenant: Any, priority: Any) -> None:
    """A :class:`ConfigError` unless ``tenant`` is a string or ``None`` and ``priority`` an
    integer (checked before a request is queued: a bad one would fail the requests beside it)."""
    check_number("priority", priority, integer=True)
    if tenant is not None and not isinstance(tenant, str):
        raise ConfigError(f"tenant must be a string or None, got {type(tenant).__name__}")


#: the largest magnitude of a logit bias (OpenAI's range)
MAX_LOGIT_BIAS = 100.0
#: the largest magnitude of a presence or frequency penalty (OpenAI's range)
MAX_PENALTY = 2.0


def check_number(name: str, value: Any, integer: bool = False, low: float | None = None,
                 high: float | None = None, open_low: bool = False) -> None:
    """A :class:`ConfigError` naming ``name`` unless ``value`` is a finite number (an integer
    with ``integer``; ``bool`` is neither) within ``[low, high]`` (``(low, high]`` with
    ``open_low``)."""
    kinds = (Integral,) if integer else (Integral, Real)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ConfigError(f"{name} must be {'an integer' if integer else 'a finite number'}, got {value!r}")
    below = low is not None and (value <= low if open_low else value < low)
    if below or (high is not None and value > high):
        lo = "" if low is None else f"{'>' if open_low else '>='} {low:g}"
        hi = "" if high is None else f"<= {high:g}"
        raise ConfigError(f"{name} must be {' and '.join(x for x in (lo, hi) if x)}, got {value}")


def check_params(params: GenerationParams, vocab_size: int | None = None) -> None:
    """Raise a :class:`~sot.errors.ConfigError` naming the first setting of ``params`` of the
    wrong type or out of range, so that a bad request fails alone, before it joins a batch."""
    if not isinstance(params, GenerationParams):
        raise ConfigError(f"params must be a GenerationParams, got {type(params).__name__}")
    check_number("max_new_tokens", params.max_new_tokens, integer=True, low=1)
    sp = params.sampling
    if not isinstance(sp, SamplingParams):
        raise ConfigError(f"sampling must be a SamplingParams, got {type(sp).__name__}")
    check_number("temperature", sp.temperature, low=0)
    check_number("top_p", sp.top_p, low=0, high=1, open_low=True)
    check_number("top_k", sp.top_k, integer=True, low=-1)  # (-1: off, as vLLM spells it; so is 0)
    check_number("min_p", sp.min_p, low=0, high=1)
    check_number("seed", sp.seed, integer=True)
    if not isinstance(sp.mode, SamplingMode):
        raise ConfigError(f"the sampling mode must be a SamplingMode, got {sp.mode!r}")
    if params.cache_salt is not None and not (isinstance(params.cache_salt, str) and params.cache_salt):
        raise ConfigError(f"cache_salt must be a non-empty string or None, got {params.cache_salt!r}")
    stop = params.stop
    if isinstance(stop, str) or not isinstance(stop, (tuple, list)) or not all(
            isinstance(x, str) and x for x in stop):
        raise ConfigError(f"stop must be a list of non-empty strings, got {stop!r}")
    if not isinstance(params.eos_token_ids, (tuple, list)) or not all(
            isinstance(t, Integral) and not isinstance(t, bool) for t in params.eos_token_ids):
        raise ConfigError(f"eos_token_ids must be token ids, got {params.eos_token_ids!r}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            check_number(name, getattr(params, name), integer=True, low=0, high=MAX_TOP_LOGPROBS)
    check_number("min_tokens", params.min_tokens, integer=True, low=0)
    if not isinstance(params.prediction, (tuple, list)) or not all(
            isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 and (not vocab_size or t < vocab_size)
            for t in params.prediction):
        raise ConfigError(f"prediction must be a list of token ids in the vocabulary, got {params.prediction!r:.80}")
    if not isinstance(params.skip_special_tokens, bool):
        raise ConfigError(f"skip_special_tokens must be True or False, got {params.skip_special_tokens!r}")
    for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        check_number(name, getattr(sp, name))
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in sp.logit_bias):
        raise ConfigError(f"logit_bias must be (token, bias) pairs, got {sp.logit_bias!r}")
    for token, bias in sp.logit_bias:
        check_number("a logit_bias token", token, integer=True)
        check_number(f"the logit_bias of token {token}", bias)
    from sot.structured import StructuredOutput

    if params.structured is not None and not isinstance(params.structured, StructuredOutput):
        raise ConfigError(f"structured must be a StructuredOutput, got {type(params.structured).__name__}")
    check_logit_rules(params, vocab_size)


def check_logit_rules(params: GenerationParams, vocab_size: int | None = None) -> None:
    """Raise a :class:`~sot.errors.ConfigError` naming a penalty, bias or minimum length out
    of range (bias tokens are checked against ``vocab_size`` when given)."""
    sp = params.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not -MAX_PENALTY <= v <= MAX_PENALTY:
            raise ConfigError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {v}")
    if not sp.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty must be > 0, got {sp.repetition_penalty}")
    for token, bias in sp.logit_bias:
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias of token {token} must be between -{MAX_LOGIT_BIAS:g} and "
                              f"{MAX_LOGIT_BIAS:g}, got {bias}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ConfigError(f"logit_bias names token {token}, outside the vocabulary of {vocab_size} tokens")
    if not 0 <= params.min_tokens <= params.max_new_tokens:
        raise ConfigError(f"min_tokens must be between 0 and max_new_tokens ({params.max_new_tokens}), "
                          f"got {params.min_tokens}")


@dataclass
class StagedPrompt:
    """A prompt read in part over earlier steps (the engine's ``prompt_budget``): its first
    ``length`` rows in slot 0 of a cache of its own, and their target states (``[n_i, S, D]``
    pieces; empty without state layers)."""

    cache: KVCache
    states: list[torch.Tensor]
    length: int


@dataclass
class LiveRequest:
    """A request the engine holds: its settings, its result so far, its random stream and the
    target states the drafter has not read yet."""

    id: int
    prompt: list[int]
    params: GenerationParams
    result: SequenceResult
    generator: torch.Generator | None
    arrived: float  # when the request was added
    started: float = 0.0  # when it was admitted: its clocks (seconds, first token) run from here
    #: target states of the rows committed since the drafter last saw this sequence, in the
    #: pieces the passes produced (``[n_i, S, D]`` each); joined once, by :meth:`take_states`,
    #: when the sequence drafts again (joining them every step would copy the whole backlog)
    state_parts: list[torch.Tensor] = field(default_factory=list)
    done: bool = False
    tenant: str | None = None  # who sent it, for drafters that keep answers per tenant
    #: waiting requests are admitted lowest value first, in arrival order within a value
    priority: int = 0
    #: with a prefix cache, the target states of every committed row (``[n_i, S, D]`` pieces),
    #: stored with the rows when the sequence leaves
    history: list[torch.Tensor] | None = None
    #: while waiting: the part of the prompt already read (``None``: none)
    staged: StagedPrompt | None = None
    #: with stop strings: the answer's text so far, decoded as tokens come
    decoded: IncrementalText | None = None
    #: with structured output: the grammar's matcher, standing after the committed tokens
    matcher: Any = field(default=None, repr=False)
    #: with a repetition penalty: which tokens the prompt holds (``[V]`` bool)
    _prompt_seen: torch.Tensor | None = field(default=None, repr=False)

    def prompt_seen(self, vocab: int) -> torch.Tensor:
        """``[V]`` bool: the tokens that occur in the prompt (made once)."""
        if self._prompt_seen is None:
            self._prompt_seen = torch.zeros(vocab, dtype=torch.bool)
            self._prompt_seen[torch.tensor(self.prompt, dtype=torch.long)] = True
        return self._prompt_seen

    def add_states(self, states: torch.Tensor) -> None:
        """Keep ``states [n, S, D]`` of newly committed rows for the drafter."""
        self.state_parts.append(states)

    def take_states(self) -> torch.Tensor | None:
        """``[n, S, D]``: every state kept since the drafter last read this sequence (``None``
        when there is none); they are handed over, so the next call starts empty."""
        parts, self.state_parts = self.state_parts, []
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.result.token_ids

    @property
    def length(self) -> int:
        """``len(context)``, without building it."""
        return len(self.prompt) + len(self.result.token_ids)

    @property
    def root(self) -> int:
        """The last token: the root of the next tree."""
        return self.result.token_ids[-1] if self.result.token_ids else self.prompt[-1]

    def finish(self, reason: str, decode: Callable[[list[int]], str]) -> None:
        """Mark the request finished with ``reason`` (``eos``, ``length``, ``stop``, ``abort``,
        ``grammar``)."""
        self.done = True
        self.result.finish_reason = reason
        self.result.text = decode(self.result.token_ids)

    def _extend_text(self, tok: int) -> bool:
        """Add ``tok``'s text to ``decoded`` (it follows every token) and return whether the
        answer's text now holds a stop string that it did not hold before."""
        decoded, params = self.decoded, self.params
        settled = decoded.settled_length  # text before it that no later token changes
        decoded.extend([tok])
        text = decoded.text
        return any(text.find(s, max(0, settled - len(s) + 1)) >= 0 for s in params.stop)

    def commit(self, tokens: list[int], now: float, decode: Callable[[list[int]], str], *,
               counts_as_step: bool) -> TokenEvent:
        """Append ``tokens`` up to the first stop condition and return the event that reports
        them; ``counts_as_step`` records the count as an accepted length (the prompt's first
        token is not one).

        The conditions are checked after each token, as plain decoding meets them one token a
        step, so an accepted run ends where plain decoding would have ended: at an
        end-of-sequence token, at a completed grammar, at the token whose text completes a
        stop string, or at ``max_new_tokens``. A stop string completed by the last allowed
        token is a ``stop``, not a ``length``."""
        res, params = self.result, self.params
        before = len(res.token_ids)
        taken: list[int] = []
        reason = None
        if params.stop and self.decoded is None:
            self.decoded = IncrementalText(decode)
        for tok in tokens:
            taken.append(tok)
            res.token_ids.append(tok)
            if self.matcher is not None and self.matcher.try_consume_tokens([tok]) != 1:
                # a dead end: the grammar allows no token of this vocabulary (an enum's "é" that
                # no token spells), so its mask held only the end of sequence, which it refuses,
                # or the request's other rules banned what it allowed (stop_token_ids under
                # min_tokens), so every token was banned; or the grammar engine failed (its
                # message kept, for the caller to report). The refused token is not the
                # answer's: it ends before it, short of its form.
                taken.pop()
                res.token_ids.pop()
                reason = "grammar"
                if self.matcher.is_error():
                    res.error = "the grammar engine stopped: " + grammar_error(self.matcher)
                break
            if tok in params.eos_token_ids:
                reason = "eos"
                break
            if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete
                reason = "stop"
                break
            # (the text follows every token; stop strings count from the token after the first
            # min_tokens, as in vLLM)
            completes = bool(params.stop) and self._extend_text(tok)
            if completes and len(res.token_ids) > params.min_tokens:
                reason = "stop"
                break
            if len(res.token_ids) >= params.max_new_tokens:
                reason = "length"
                break
        if counts_as_step:
            res.accept_lengths.append(len(taken))
        res.seconds = now - self.started
        # the acceptance added a log probability per offered token: keep those committed
        del res.logprobs[len(res.token_ids):]
        if reason is not None:
            self.finish(reason, decode)
        return TokenEvent(sequence=res.index, token_ids=taken, finished=self.done, request_id=self.id,
                          finish_reason=reason, result=res if self.done else None, logprobs=res.logprobs[before:])
