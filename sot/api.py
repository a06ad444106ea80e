"""The Python API: load once, then generate or stream for a list of prompts.

Example::

    from sot import SoT
    sot = SoT.load("default")  # the shipped state predictor drafts
    for out in sot.generate(["Write a haiku about the sea."], max_new_tokens=64):
        print(out.text, out.tokens_per_s, out.mean_accept_len)
"""
from __future__ import annotations

import collections.abc
import math
import os
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence


from sot.attention import MAX_TREE_NODES
from sot.drafters import DRAFT_TOP_K, DrafterKind, SuffixStores, TreeBudget, auto_drafter_kind, make_drafter
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.fingerprint import tokenizer_hash
from sot.models.adapter import TargetModel
from sot.dtype_choice import DtypeChoice
from sot.detokenize import TextAssembler, decoder, first_stop, token_label, token_pieces
from sot.dtype_choice import resolve as resolve_dtype_choice
from sot.machine import set_threads
from sot.models.loading import DEFAULT_DEVICE, KV_CACHE_DTYPES, load_model, resolve_device
from sot.online.adapt import AdaptConfig, Adapter
from sot.policy import PolicyConfig, PolicyKind
from sot.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from sot.prompts import (
    PromptItem, check_utf8, encode, has_chat_template, read_chat_template, use_chat_template, with_tools,
)
from sot.requests import SequenceResult, check_number, check_params, check_prompts
from sot.sampling import MAX_TOP_LOGPROBS, SamplingMode, SamplingParams, TokenLogprob
from sot.structured import Grammars, StructuredOutput
from sot.tools import ToolUse
from sot.trace import StepRecord, TracedSequence, compare_states


@dataclass
class Completion:
    """One prompt's output and its speed figures.

    ``seconds`` runs from the request's admission to its last token, ``first_token_seconds``
    to its first; ``tokens_per_s`` is ``new_tokens / seconds``; ``mean_accept_len`` (tau) is
    the tokens committed per verify step; ``finish_reason`` is ``length``, ``eos``, ``stop``,
    ``abort`` or ``grammar`` (the structured output's grammar allowed no token of the model's
    vocabulary, so the answer stops short of its form)."""

    text: str
    token_ids: list[int]
    new_tokens: int
    seconds: float
    tokens_per_s: float
    mean_accept_len: float
    steps: int
    finish_reason: str
    prompt_tokens: int
    first_token_seconds: float
    accept_lengths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    plain_steps: int = 0
    fallbacks: int = 0
    #: prompt tokens taken from the prefix cache (rows of earlier prompts and answers)
    cached_tokens: int = 0
    #: with ``logprobs`` asked for: one :class:`~sot.sampling.TokenLogprob` per token of ``token_ids``
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: with ``trace=True``: one :class:`~sot.trace.StepRecord` per verify step
    step_records: list[StepRecord] = field(default_factory=list)
    #: with tools offered: the calls read from ``text``, in OpenAI's form (``{"id", "type":
    #: "function", "function": {"name", "arguments"}}``, arguments as JSON text)
    tool_calls: list[dict] = field(default_factory=list)
    #: with a ``grammar`` finish caused by the grammar engine failing (a pattern past its size
    #: limits) rather than by a dead end: the engine's message; else ``None``
    error: str | None = None

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (step records left out; logprobs and tool calls
        only where there are any)."""
        out = asdict(self)
        out.pop("step_records")  # large; written by sot.trace.write_trace instead
        if not self.logprobs:
            out.pop("logprobs")
        if not self.tool_calls:
            out.pop("tool_calls")
        if self.error is None:
            out.pop("error")
        return out


@dataclass
class Score:
    """A text's tokens and their log probabilities under the model (:meth:`SoT.score`)."""

    token_ids: list[int]
    #: one per token: the first has none (``None``), each other its log probability after
    #: the tokens before it, with the asked-for number of alternatives
    logprobs: list[TokenLogprob | None]

    @property
    def scored_tokens(self) -> int:
        """Tokens with a log probability (all but the first)."""
        return sum(e is not None for e in self.logprobs)

    @property
    def total_logprob(self) -> float:
        """The log-likelihood of the text after its first token (natural log)."""
        return float(sum(e.logprob for e in self.logprobs if e is not None))

    @property
    def perplexity(self) -> float:
        """``exp(-total_logprob / scored_tokens)``; ``nan`` for a text of one token."""
        n = self.scored_tokens
        return math.exp(-self.total_logprob / n) if n else math.nan

    def to_dict(self) -> dict:
        """The figures as JSON-ready values (a perplexity of ``nan`` as ``None``)."""
        return {"token_ids": self.token_ids, "scored_tokens": self.scored_tokens,
                "total_logprob": self.total_logprob,
                "perplexity": None if math.isnan(self.perplexity) else self.perplexity,  # (JSON has no NaN)
                "logprobs": [None if e is None else asdict(e) for e in self.logprobs]}


@dataclass(frozen=True)
class StreamEvent:
    """New text of one prompt (``index``) as tokens are committed: ``text`` may be empty while
    it could still turn into a stop string, but ``token_ids`` always holds the step's tokens."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool
    #: on the last event: ``length``, ``eos``, ``stop``, ``abort`` or ``grammar``
    finish_reason: str | None = None


class SoT:
    """A loaded target model with a drafter, ready to generate.

    Use :meth:`load`; the constructor takes already-built parts.
    """

    def __init__(self, target: TargetModel, tokenizer: Any, engine: Engine, name: str) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.engine = engine
        self.name = name
        #: engine results of the last :meth:`stream` call (statistics of each sequence)
        self.last_stream: list = []
        #: the test-time adapter of the state predictor (``load(adapt=...)``), or ``None``
        self.adapter: Adapter | None = None
        #: how the dtype was chosen (``dtype="auto"``: measured or read from the cache)
        self.dtype_choice: DtypeChoice | None = None
        #: the :class:`~sot.aio.AsyncSoT` whose thread steps the engine, while one runs
        self._async_front: object | None = None
        if engine.grammars is None:  # structured output needs the tokenizer, which the engine lacks
            engine.grammars = Grammars(tokenizer, target.vocab_size, self.eos_ids())

    @classmethod
    def load(
        cls,
        model: str = "default",
        drafter: str | DrafterKind = "auto",
        dtype: str = "auto",
        max_nodes: int = TreeBudget.max_nodes,
        max_depth: int = TreeBudget.max_depth,
        predictor: str | None = None,
        predictor_nodes: int = TreeBudget.predictor_nodes,
        predictor_depth: int = TreeBudget.predictor_depth,
        top_k: int = DRAFT_TOP_K,
        policy: PolicyConfig | str | None = None,
        suffix_store: str | None = None,
        suffix_per_tenant: bool = False,
        adapt: AdaptConfig | None = None,
        prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB,
        chat_template: str | None = None,
        lora: str | None = None,
        device: str = DEFAULT_DEVICE,
        kv_cache_dtype: str = "auto",
        threads: int | None = None,
    ) -> "SoT":
        """Load a target and build the engine.

        Args:
            model: ``"default"`` (SmolLM2-135M-Instruct), a model folder or a ``.gguf`` file.
            drafter: ``auto`` (the state predictor with suffix trees and prompt lookup when
                a predictor fits the model, otherwise suffix trees and prompt lookup),
                ``none``, ``pld``, ``suffix`` or ``state`` (the predictor with prompt lookup).
            dtype: ``auto`` (default: the mode that decodes fastest on this machine with this
                model and drafter, timed once and cached; :mod:`sot.dtype_choice`), ``bfloat16``,
                ``float32`` or ``int8`` (a GGUF model's blocks multiplied in 8-bit integers, as
                llama.cpp does). Greedy output is identical to plain decoding in each.
            max_nodes: nodes a sequence verifies per step at most, root included, whatever
                drafted them.
            max_depth: how many tokens ahead a tree may reach.
            predictor_nodes: nodes of the state predictor's own tree at most (the free
                drafts, prompt lookup and suffix trees, may add more, up to ``max_nodes``).
            predictor_depth: levels of the state predictor's own tree at most (each is one
                predictor pass).
            predictor: a state predictor file or an EAGLE-3 head folder (default: the one
                shipped for the default model).
            top_k: children per expanded node in state-predictor trees.
            policy: the commit policy (default: heuristic, no warm-up), or its kind's name
                (``"static"``, ``"learned"``, ...) with the other settings at their defaults.
            suffix_store: a file of earlier answers to draft from (read if it exists; write
                it back with :meth:`save_suffix_store`).
            suffix_per_tenant: keep earlier answers apart per tenant (``add_request``'s
                ``tenant``), so one tenant's answers never draft another's.
            adapt: test-time adaptation of the state predictor (:mod:`sot.online.adapt`);
                ``None``: the predictor stays as loaded.
            prefix_cache_mb: memory for prompt chunks already read, reused by later prompts
                that start with the same tokens (:mod:`sot.prefix_cache`; exact); kept apart
                per tenant with ``suffix_per_tenant``. 0 turns it off.
            chat_template: a Jinja chat template (its text or a file) to use instead of the
                tokenizer's own, or for a model without one.
            lora: a LoRA adapter folder (PEFT's format) merged into the weights at load
                (:func:`sot.models.loading.merge_lora`).
            device: ``auto`` (default: a CUDA GPU when one is visible, else the CPU), ``cpu``,
                ``cuda`` or ``cuda:N``: where the target, its cache and the predictor live.
            kv_cache_dtype: ``auto`` (the engine's: float32, or bfloat16 for a bfloat16 one),
                ``float32``, ``bfloat16`` or ``float16``: with a float32 engine (``float32`` or
                ``int8``) the last two halve the bytes attention reads, faster at long contexts,
                and round the keys and values the cache holds, so answers may differ slightly
                from float32's (speculation stays exact). SoT's CPU attention only.
            threads: CPU threads of the model's passes (``torch.set_num_threads``, for the
                whole process; ``None``, default: as they are, PyTorch's one per core). Set
                before ``dtype="auto"`` times the modes, whose choice is kept per thread count.
        """
        if not isinstance(model, (str, os.PathLike)):
            raise ConfigError(f"model must be 'default', a model folder or a .gguf file path, got {model!r}")
        for name, value, low, high in (("max_nodes", max_nodes, 1, MAX_TREE_NODES), ("max_depth", max_depth, 0, None),
                                       ("predictor_nodes", predictor_nodes, 1, MAX_TREE_NODES),
                                       ("predictor_depth", predictor_depth, 0, None), ("top_k", top_k, 1, None),
                                       ("prefix_cache_mb", prefix_cache_mb, 0, None)):
            check_number(name, value, integer=True, low=low, high=high)
        if drafter != "auto" and drafter not in {k.value for k in DrafterKind}:
            choices = ", ".join(["auto"] + [k.value for k in DrafterKind])
            raise ConfigError(f"unknown drafter {drafter!r}; choose from {choices}")
        if isinstance(policy, str):
            try:
                policy = PolicyConfig(kind=PolicyKind(policy))
            except ValueError:
                kinds = ", ".join(k.value for k in PolicyKind)
                raise ConfigError(f"unknown policy {policy!r}; choose from {kinds}") from None
        elif policy is not None and not isinstance(policy, PolicyConfig):
            raise ConfigError(f"policy must be a PolicyConfig or a policy name, got {type(policy).__name__}")
        if suffix_store is not None and drafter not in ("auto", DrafterKind.SUFFIX.value):
            raise ConfigError("suffix_store needs a drafter that drafts from earlier answers (auto or suffix)")
        if suffix_store is not None and Path(suffix_store).is_dir():
            raise ConfigError(f"suffix_store {suffix_store} is a folder: name a file (read if it exists, written by "
                              "save_suffix_store)")
        if predictor is not None and drafter not in ("auto", DrafterKind.STATE.value):
            raise ConfigError(f"predictor is read by the auto and state drafters only, not by {drafter}")
        # (these two before the model loads, not after)
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
        template = read_chat_template(chat_template) if chat_template is not None else None
        if threads is not None:
            check_number("threads", threads, integer=True, low=1)
            set_threads(threads)
        dev = resolve_device("cpu" if dtype == "int8" and device == "auto" else device)  # (int8 runs on the CPU)
        choice = resolve_dtype_choice(dtype, model, drafter, predictor, device=str(dev))
        loaded = load_model(model, dtype=choice.torch_dtype, device=dev, lora=lora, int8=choice.int8)
        stores = None
        kind = auto_drafter_kind(loaded.model, predictor) if drafter == "auto" else DrafterKind(drafter)
        if drafter == "auto" or kind is DrafterKind.SUFFIX:  # (auto keeps the stores whichever drafter it takes)
            vocab = int(loaded.model.get_input_embeddings().weight.shape[0])
            stores = SuffixStores(per_tenant=suffix_per_tenant, vocab_size=vocab,
                                  tokenizer=tokenizer_hash(loaded.tokenizer))
        if suffix_store is not None and Path(suffix_store).is_file():  # (stores exist: the drafter was checked)
            stores.load(suffix_store)
        draft = make_drafter(kind, loaded.model, predictor, top_k=top_k, suffix=stores)
        target = TargetModel(loaded.model, state_layers=draft.state_layers, kv_cache_dtype=kv_cache_dtype)
        tok = loaded.tokenizer
        if template is not None:
            use_chat_template(tok, template)

        prefix = PrefixCache(prefix_cache_mb << 20, per_tenant=suffix_per_tenant) if prefix_cache_mb else None
        budget = TreeBudget(max_nodes=max_nodes, max_depth=max_depth, predictor_nodes=predictor_nodes,
                            predictor_depth=predictor_depth)
        engine = Engine(target, draft, budget,
                        decode=decoder(tok, skip_special=True), policy=policy, prefix_cache=prefix)
        engine.decode_special = decoder(tok, skip_special=False)
        out = cls(target, tok, engine, loaded.name)
        out.dtype_choice = choice
        if adapt is not None:
            out.adapter = Adapter(engine, adapt)
        return out

    # ----------------------------------------------------------------- helpers
    @property
    def suffix_stores(self) -> SuffixStores | None:
        """The drafter's stores of earlier answers (``None`` when it keeps none)."""
        return self.engine.drafter.suffix_stores

    def save_suffix_store(self, path: str) -> None:
        """Write the earlier answers the drafter keeps to ``path`` (for ``suffix_store``)."""
        if self.suffix_stores is None:
            raise ConfigError("this drafter keeps no earlier answers (use drafter auto or suffix)")
        self._check_engine_free()  # (the engine's thread adds to the stores while it runs)
        self.suffix_stores.save(path)

    @property
    def is_chat_model(self) -> bool:
        """Whether the tokenizer has a chat template (prompts are then chat messages)."""
        return has_chat_template(self.tokenizer)

    def encode(self, item: PromptItem, chat: bool | None = None, generation_prompt: bool = True,
               continue_final: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a prompt; ``chat=None`` applies the chat template when there is one
        (the other arguments: :func:`sot.prompts.encode`)."""
        if chat is not None and not isinstance(chat, bool):
            raise ConfigError(f"chat must be True, False or None (the model's own choice), got {chat!r}")
        use_chat = self.is_chat_model if chat is None else chat
        if use_chat and not self.is_chat_model:
            raise ConfigError("this model has no chat template; run without --chat or give one (--chat-template)")
        return encode(self.tokenizer, item, use_chat, generation_prompt, continue_final, template_kwargs)

    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end an answer: the tokenizer's end-of-sequence token and those of
        the model's generation config."""
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = getattr(self.target.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return tuple(sorted(ids))

    def params(
        self,
        max_new_tokens: int = GenerationParams.max_new_tokens,
        temperature: float = SamplingParams.temperature,
        top_p: float = SamplingParams.top_p,
        top_k: int = SamplingParams.top_k,
        min_p: float = SamplingParams.min_p,
        seed: int | None = SamplingParams.seed,
        sampling: str | SamplingMode = SamplingParams.mode,
        stop: str | Sequence[str] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        min_tokens: int = GenerationParams.min_tokens,
        repetition_penalty: float = SamplingParams.repetition_penalty,
        frequency_penalty: float = SamplingParams.frequency_penalty,
        presence_penalty: float = SamplingParams.presence_penalty,
        logit_bias: dict[int, float] | None = None,
        structured: StructuredOutput | None = None,
        skip_special_tokens: bool = GenerationParams.skip_special_tokens,
        cache_salt: str | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> GenerationParams:
        """Validated :class:`GenerationParams`.

        Args:
            max_new_tokens: tokens generated at most.
            temperature, top_p, top_k, min_p: sampling (temperature 0: greedy; top_k 0 or -1
                and top_p 1: off), in transformers' order (temperature, top-k, top-p, min-p;
                vLLM applies min-p before top-k and top-p, which differs where both min_p and
                top_p are set).
            seed: the sampling noise's key, with the prompt's place in the list and the
                position: with ``coupled`` sampling (the default) a seeded answer is the same
                whatever was drafted and whatever else is in the batch, for the prompt at that
                place (the server's requests are each at place 0, so two prompts in one call
                differ). The default (0) makes a call repeatable; ``None`` draws a fresh seed
                each call, as the server does for a request without one. With ``rejection``
                the answer also depends on the drafts (which draw on earlier answers), so a
                seed does not repeat it.
            sampling: ``coupled`` (same text for a seed, whatever was drafted) or
                ``rejection``; both give the target's distribution.
            stop: strings that end the answer (not included in its text); one string or a
                list.
            ignore_eos: generate past the end-of-sequence tokens, up to ``max_new_tokens``.
            logprobs: ``None``, or return each generated token's log probability with that
                many alternatives, 0 to 20.
            min_tokens: no end-of-sequence token before this many tokens, and no stop string
                that ends within them (as vLLM).
            repetition_penalty, frequency_penalty, presence_penalty, logit_bias: change the
                logits before a token is chosen, as OpenAI and vLLM define them
                (:mod:`sot.logit_rules`); ``logit_bias`` maps token ids to -100..100.
            structured: the form the answer must take: a JSON schema, any JSON object, a
                regular expression, a choice of strings or a grammar
                (:class:`~sot.structured.StructuredOutput`).
            skip_special_tokens: leave special tokens out of the answer's text (the default,
                as transformers' ``decode`` and vLLM); stop strings are found in that text.
            cache_salt: share the prefix cache's stored prompt chunks only with requests of
                this salt (vLLM's ``cache_salt``; ``None``: with every request without one).
            prediction: text (or token ids) the answer is expected to repeat in large part,
                such as a file the prompt asks to edit (OpenAI's Predicted Outputs): the
                drafters copy from it, so a good prediction makes the answer faster; the
                answer is the same with any prediction or none.
        """
        if seed is None:  # (as OpenAI and vLLM: no seed, a fresh one)
            seed = random.getrandbits(63)
        for name, flag in (("ignore_eos", ignore_eos), ("skip_special_tokens", skip_special_tokens)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
        if logit_bias is None:
            logit_bias = {}
        if not isinstance(logit_bias, collections.abc.Mapping):
            raise ConfigError(f"logit_bias must map token ids to biases, got {logit_bias!r}")
        bias = []
        for token, value in logit_bias.items():
            if isinstance(token, str) and re.fullmatch(r"\s*-?[0-9]+\s*", token):
                token = int(token)  # (JSON keys are strings)
            check_number("a logit_bias token", token, integer=True)
            check_number(f"the logit_bias of token {token}", value)
            bias.append((int(token), float(value)))
        try:
            mode = SamplingMode(sampling)
        except ValueError:
            raise ConfigError(f"sampling must be 'rejection' or 'coupled', got {sampling!r}") from None
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, mode=mode,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, logit_bias=tuple(sorted(bias)))
        if isinstance(prediction, str):
            prediction = self.tokenizer.encode(check_utf8(prediction, "prediction"), add_special_tokens=False)
        elif prediction is not None and not isinstance(prediction, (list, tuple)):
            raise ConfigError(f"prediction must be the expected answer's text or a list of its token ids, "
                              f"got {type(prediction).__name__}")
        params = GenerationParams(max_new_tokens=max_new_tokens, sampling=sp, stop=tuple(stop),
                                  eos_token_ids=() if ignore_eos else self.eos_ids(), logprobs=logprobs,
                                  min_tokens=min_tokens, structured=structured,
                                  skip_special_tokens=skip_special_tokens, cache_salt=cache_salt,
                                  prediction=tuple(prediction or ()))
        check_params(params, self.target.vocab_size)
        if structured is not None:
            self.engine.grammars.matcher(structured)  # a ConfigError now, not at the first step
        return params

    # ----------------------------------------------------------------- generation
    def _check_engine_free(self) -> None:
        """A :class:`ConfigError` while an :class:`~sot.aio.AsyncSoT`'s thread steps the engine:
        a second caller stepping it too would mix their sequences."""
        if self._async_front is not None:
            raise ConfigError("an AsyncSoT runs this SoT's engine: use its generate and stream, or close it first")

    def generate_ids(
        self, prompts: list[list[int]], params: GenerationParams, batch_size: int = 1, trace: bool = False,
        on_done: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """Generate from token-id prompts, at most ``batch_size`` sequences at a time (a
        continuous batch: a finished sequence's place goes to the next prompt). With
        ``trace``, each completion keeps its step records (see :meth:`traced`).
        ``on_done(i, completion)`` is called as each prompt's answer finishes, in the order
        they finish (so a caller keeps the answers done before an interrupt)."""
        self._check_engine_free()
        check_number("batch_size", batch_size, integer=True, low=1)
        if not isinstance(prompts, (list, tuple)):
            raise ConfigError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not isinstance(trace, bool):
            raise ConfigError(f"trace must be True or False, got {trace!r}")
        if not prompts:
            return []
        results: list[SequenceResult] = []
        for event in self.engine.stream(prompts, params, results, batch_size, record_steps=trace):
            if event.finished and on_done is not None:
                i = event.sequence
                on_done(i, self._completion(prompts[i], event.result or results[i], params))
        return [self._completion(p, r, params) for p, r in zip(prompts, results)]

    def _completion(self, prompt: list[int], res: SequenceResult, params: GenerationParams) -> Completion:
        """The :class:`Completion` of one finished request (its text cut at a stop string)."""
        text = res.text
        if params.stop:  # (the text the engine stopped on: a string counts after min_tokens tokens)
            decode = self.engine.decode if params.skip_special_tokens else self.engine.decode_special
            floor = len(decode(res.token_ids[: params.min_tokens])) if params.min_tokens else 0
            found = first_stop(text, params.stop, floor=floor)
            if found is not None:
                text = text[: found[0]]
        return Completion(
            text=text,
            token_ids=res.token_ids,
            new_tokens=res.new_tokens,
            seconds=res.seconds,
            tokens_per_s=res.tokens_per_s,
            mean_accept_len=res.mean_accept_len,
            steps=res.steps,
            finish_reason=res.finish_reason,
            prompt_tokens=len(prompt),
            first_token_seconds=res.first_token_seconds,
            accept_lengths=res.accept_lengths,
            depth_attempts=res.depth_attempts,
            depth_accepts=res.depth_accepts,
            tree_sizes=res.tree_sizes,
            plain_steps=res.plain_steps,
            fallbacks=res.fallbacks,
            cached_tokens=res.cached_tokens,
            logprobs=res.logprobs,
            step_records=res.step_records,
            error=res.error,
        )

    def trace_run(self, **extra: Any) -> dict[str, Any]:
        """The run a trace describes (its page's title): model, drafter, dtype and version,
        with ``extra`` (a request's id, say)."""
        from sot import __version__
        from sot.models.loading import dtype_name

        return {"model": self.name, "drafter": self.engine.drafter.kind.value,
                "dtype": dtype_name(self.target.dtype), "version": __version__, **extra}

    def traced(self, prompts: list[list[int]], completions: list[Completion]) -> list[TracedSequence]:
        """The traces of completions generated with ``trace=True`` from ``prompts`` (token
        ids): each answer's tokens as text pieces, its step records and, where the state
        drafter predicted states, their comparison with the target's actual states (one
        forward of the target over the prompt and answer)."""
        out = []
        for i, (prompt, c) in enumerate(zip(prompts, completions)):
            states = None
            if any(r.predicted for r in c.step_records):
                states = compare_states(self.target.model, prompt, c.token_ids, c.step_records)
            pieces = token_pieces(self.tokenizer, c.token_ids)
            out.append(TracedSequence(
                index=i, prompt_ids=list(prompt), token_ids=list(c.token_ids), pieces=pieces, text=c.text,
                finish_reason=c.finish_reason, tau=round(c.mean_accept_len, 4), seconds=round(c.seconds, 4),
                steps=[r.to_json() for r in c.step_records], states=states,
                vocab={str(t): token_label(self.tokenizer, t)
                       for t in sorted({t for r in c.step_records for t in r.tokens})},
            ))
        return out

    def generate(
        self, prompts: PromptItem | Sequence[PromptItem], chat: bool | None = None, batch_size: int = 1,
        trace: bool = False, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True, **kwargs: Any,
    ) -> list[Completion]:
        """Generate for each prompt (a string or a JSONL-style record, or a list of them: one
        completion each); ``trace`` keeps each completion's step records
        (:attr:`Completion.step_records`).

        ``chat``: apply the chat template (``None``, default: when the tokenizer has one).
        ``batch_size``: sequences decoding together (default 1: one prompt after another;
        larger, a continuous batch where a finished sequence's place goes to the next prompt).
        Each answer is the same at any batch size.

        ``tools`` (OpenAI's function list) are offered in the chat template, and the calls
        read from each answer are in :attr:`Completion.tool_calls`; ``tool_choice`` is
        ``auto`` (default), ``none``, ``required`` or ``{"type": "function", "function":
        {"name"}}``, the last two held to the tools' schemas by a grammar (:mod:`sot.tools`).

        Other keyword arguments are those of :meth:`params` (``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``sampling``, ``stop``, ...).
        """
        prompts = _as_list(prompts)
        use = ToolUse.of(tools or [], tool_choice, parallel_tool_calls)
        if use.format() is not None:
            if kwargs.get("structured") is not None:
                raise ConfigError(f"tool_choice {use.choice.mode!r} fixes the answer's form; leave out structured")
            kwargs["structured"] = use.format()
        if tools:
            if not self.is_chat_model or chat is False:
                raise ConfigError("tools are offered through the chat template: this model has none, "
                                  "or chat=False was asked for")
            prompts, chat = [with_tools(p, use.offered()) for p in prompts], True
        params = self.params(**kwargs)
        ids = [self.encode(p, chat) for p in prompts]
        out = self.generate_ids(ids, params, batch_size, trace=trace)
        if use.choice.calls_tools:
            for c in out:
                c.tool_calls = [call.to_openai() for call in use.read(c.text).calls]
        return out

    def score(self, texts: PromptItem | Sequence[PromptItem], chat: bool | None = False, top_logprobs: int = 0,
              batch_size: int = 1) -> list[Score]:
        """Each text's tokens with their log probabilities under the model: the figures plain
        decoding would give each token after the ones before it (the texts are read by the
        engine's verify passes, ``batch_size`` at a time; nothing is generated beyond one
        token, dropped).

        Args:
            texts: strings (raw text by default), or records with ``messages`` and
                ``chat=True`` to score a conversation in the chat template (as it is, with no
                answer opened after it); one text or a list.
            top_logprobs: alternatives to report per token (0-20).
        """
        self._check_engine_free()
        check_number("top_logprobs", top_logprobs, integer=True, low=0, high=MAX_TOP_LOGPROBS)
        # a text is scored as given: a conversation ends with its last message, not with the
        # opening of an answer
        ids = [self.encode(t, chat, generation_prompt=False) for t in _as_list(texts)]
        limit = self.target.max_positions
        for i, p in enumerate(ids):  # (the pass that reads a text also opens one token after it)
            if limit and len(p) >= limit:
                raise ConfigError(f"text {i} has {len(p)} tokens; this model scores at most {limit - 1} "
                                  f"(its context is {limit} tokens)")
        params = GenerationParams(max_new_tokens=1, prompt_logprobs=top_logprobs)
        results = self.engine.generate(ids, params, batch_size) if ids else []
        return [Score(p, list(r.prompt_logprobs)) for p, r in zip(ids, results)]

    def stream(
        self, prompts: PromptItem | Sequence[PromptItem], chat: bool | None = None, batch_size: int | None = None,
        **kwargs: Any,
    ) -> Iterator[StreamEvent]:
        """Yield text as it is committed, for prompts generated together (at most
        ``batch_size`` at a time, as a continuous batch; default: all at once). Settings as
        :meth:`params`; with ``logprobs``, each prompt's token log probabilities are in its
        :class:`~sot.engine.SequenceResult` in ``last_stream`` once the stream has ended.

        The arguments are checked at the call, before the first event is asked for."""
        self._check_engine_free()
        params = self.params(**kwargs)
        ids = [self.encode(p, chat) for p in _as_list(prompts)]
        if ids:
            check_prompts(ids, params, self.target.max_positions, batch_size, self.target.vocab_size)
        return self._stream_ids(ids, params, batch_size)

    def _stream_ids(self, ids: list[list[int]], params: GenerationParams,
                    batch_size: int | None) -> Iterator[StreamEvent]:
        """:meth:`stream`'s events for checked token-id prompts."""
        if not ids:  # (as generate and score: nothing asked, nothing given)
            return
        # an incomplete character, and text that may begin a stop string, wait for the next
        # tokens; a stop string ends the text before it
        texts = [TextAssembler(self.tokenizer, params.stop, min_tokens=params.min_tokens,
                               skip_special=params.skip_special_tokens) for _ in ids]
        self.last_stream = []
        for event in self.engine.stream(ids, params, self.last_stream, batch_size):
            delta = texts[event.sequence].add(event.token_ids, final=event.finished)
            yield StreamEvent(event.sequence, delta, event.token_ids, event.finished, event.finish_reason)


def _as_list(prompts: PromptItem | Sequence[PromptItem]) -> list[PromptItem]:
    """One prompt (a string or a record) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, collections.abc.Iterable):
        kind = type(prompts).__name__
        raise ConfigError(f"expected a prompt (a string or a record) or a list of prompts, got {kind}")
    return list(prompts)
