"""Structured output: answers held to a JSON schema, to any JSON object, to a regular
expression, to one of a list of strings, or to a grammar (Lark or GBNF), with llguidance
(the constraint engine vLLM and llama.cpp use).

A grammar is a rule on the logits like the others of :mod:`sot.logit_rules`: each row may
only choose a token the grammar allows after that row's context. The matcher follows the
acceptance walk down a draft tree (it takes a node's token, and the node's row is masked
for that context; it rolls back afterwards), so every row is masked for its own path; plain
decoding masks its one row for the same context, so speculative output stays exactly plain
decoding's. A drafted token the grammar forbids is simply rejected. The answer ends when the
grammar is complete.
"""
from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from sot.errors import ConfigError

if TYPE_CHECKING:
    from llguidance import LLMatcher


#: llguidance's JSON options: whitespace between JSON tokens is bounded (a model that keeps
#: choosing spaces would otherwise never finish); a schema's ``"x-guidance"`` object
#: overrides them (``{"whitespace_flexible": false, "whitespace_pattern": null}``: compact)
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,48}"}


class OutputFormat(str, enum.Enum):
    """What a :class:`StructuredOutput` spec holds."""

    JSON = "json"  # any JSON object (the spec is empty)
    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"  # a regular expression (Rust regex syntax)
    CHOICE = "choice"  # a JSON list of strings: the answer is one of them
    GRAMMAR = "grammar"  # a Lark or GBNF (llama.cpp) grammar


@dataclass(frozen=True)
class StructuredOutput:
    """The form an answer must take (hashable, so compiled grammars are cached by it)."""

    format: OutputFormat
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: str | dict) -> "StructuredOutput":
        return cls(OutputFormat.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: Sequence[str]) -> "StructuredOutput":
        if not options or not all(isinstance(o, str) for o in options):
            raise ConfigError("a choice needs a non-empty list of strings")
        return cls(OutputFormat.CHOICE, json.dumps(list(options)))

    def grammar(self) -> str:
        """llguidance's grammar text of this spec (raises :class:`ConfigError` on a spec that
        is not even well formed; :meth:`Grammars.matcher` checks the rest)."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.format is OutputFormat.JSON:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.format is OutputFormat.JSON_SCHEMA:
                return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
            if self.format is OutputFormat.REGEX:
                return LLMatcher.grammar_from_regex(self.spec)
            if self.format is OutputFormat.CHOICE:
                return grammar_from("choice", self.spec)
            return grammar_from("grammar", self.spec)
        except ValueError as exc:
            raise ConfigError(f"the {self.format.value} is not valid: {one_line(str(exc))}") from None

    def check(self) -> None:
        """Raise :class:`ConfigError`, with the reason, unless the spec compiles (no tokenizer
        needed: the command line checks it before a model loads)."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ConfigError(f"the {self.format.value} is not valid: {one_line(error)}")


def one_line(error: str) -> str:
    """llguidance's error, whose later lines draw carets under the spec, as one line: its
    first line and the cause it names (``error: ...``)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    cause = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return " ".join(part for part in (lines[0] if lines else "unknown error", cause) if part)


def grammar_error(matcher: Any) -> str:
    """The first line of a failed matcher's error (llguidance's words)."""
    lines = [line.strip() for line in (matcher.get_error() or "").splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"


class Grammars:
    """Grammar matchers for one tokenizer. The tokenizer's table for llguidance is built on
    the first structured request (about a second) and compiled specs are cached.

    Args:
        tokenizer: a Hugging Face tokenizer (a fast one is read as it is; any other through
            each token's decoded bytes).
        vocab_size: the model's logits width (may exceed the tokenizer's).
        eos_token_ids: the tokens that end an answer once the grammar is complete.
    """

    #: compiled specs kept (a matcher per spec, copied for each request)
    CACHED = 64

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self._table = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server checks specs on its event loop's threads

    def _lltokenizer(self):
        if self._table is None:
            import llguidance
            import llguidance.hf

            eos = self.eos or None
            try:
                self._table = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            except ValueError:  # a tokenizer llguidance does not read: give it each token's bytes
                wrapped = llguidance.TokenizerWrapper(_TokenBytes(self.tokenizer, self.vocab_size))
                self._table = llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=eos)
        return self._table

    def forget(self, spec: StructuredOutput) -> None:
        """Drop ``spec``'s compiled matcher, after a copy of it failed: the copies share its
        lexer's limits, so an answer that used them up would spoil the next ones."""
        with self._lock:
            self._compiled.pop(spec, None)

    def matcher(self, spec: StructuredOutput) -> LLMatcher:
        """A fresh matcher at the start of an answer (a copy of the spec's compiled one);
        :class:`ConfigError` naming what is wrong with an invalid spec."""
        from llguidance import LLMatcher

        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
            table = self._lltokenizer()
        compiled = LLMatcher(table, spec.grammar(), log_level=0)  # (compiling drops the GIL)
        if compiled.is_error():
            raise ConfigError(f"the {spec.format.value} is not valid: {one_line(compiled.get_error())}")
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        fresh = compiled.deep_copy()
        if fresh.is_error():  # (too large to start at all)
            raise ConfigError(f"the {spec.format.value} is too large for the grammar engine: {grammar_error(fresh)}")
        return fresh


class _TokenBytes:
    """A tokenizer as llguidance's generic wrapper reads one: every token's bytes (its
    decoded text; none for special tokens and ids past the tokenizer), the special ids, and
    encoding."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []))
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        size = len(tokenizer)
        self.tokens = [b"" if i in special or i >= size else tokenizer.decode([i]).encode("utf-8")
                       for i in range(vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def allowed_tokens(matcher: LLMatcher, vocab: int) -> torch.Tensor:
    """``[V]`` bool: the tokens the grammar allows next."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab].astype(bool))
