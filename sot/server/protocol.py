"""Request bodies of the OpenAI-compatible API, OpenAI-style errors, and how an answer's
tokens become a response: content and tool calls (:class:`ToolAnswer`), log probabilities
(:class:`LogprobWriter`); the streamed text itself is :class:`sot.detokenize.TextAssembler`'s."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sot.detokenize import IncrementalText, TextAssembler, decoder, token_bytes, token_pieces
from sot.requests import MAX_PENALTY, GenerationParams
from sot.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from sot.errors import ConfigError
from sot.structured import OutputFormat, StructuredOutput
from sot.tools import CALL_OPEN, ReadAnswer, ToolUse, new_call_id

if TYPE_CHECKING:
    from sot.requests import SequenceResult


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, counted: bool = False) -> None:
        super().__init__(message)
        #: the request's end is already in the metrics (the engine ended it)
        self.counted = counted
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}


class NullMeansDefault(BaseModel):
    """A request body whose optional fields may be sent as ``null``, as OpenAI's API allows:
    a null stands for the field's default (``temperature: null`` is temperature 1)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].get_default() is None}


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``, with vLLM's ``continuous_usage_stats`` (with
    ``include_usage``: every chunk carries the usage so far)."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _GenerationRequest(NullMeansDefault):
    """Fields shared by chat and text completions (OpenAI's, plus ``top_k``,
    ``sampling_mode`` and ``ignore_eos`` as in vLLM-style extensions)."""

    #: the fields that hold the prompt and the answer's token limit (named in errors)
    prompt_field: ClassVar[str] = "prompt"

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # (the served model when left out, as vLLM takes it)
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(SamplingParams.min_p, ge=0.0, le=1.0, allow_inf_nan=False)
    #: a 64-bit signed integer, as vLLM bounds it
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: ``coupled`` (a seeded sample is the same text whatever was drafted, as plain decoding's)
    #: or ``rejection``; both exact in distribution (see :class:`~sot.sampling.SamplingMode`)
    sampling_mode: Literal["rejection", "coupled"] = SamplingParams.mode.value
    ignore_eos: bool = False
    #: vLLM's extension: waiting requests are admitted lowest value first (running ones are
    #: not preempted)
    priority: int = 0
    #: the end user (OpenAI's field); with ``sot serve --suffix-tenants user`` it keys the
    #: earlier answers that drafts come from, and the prefix cache's chunks
    user: str | None = None
    #: vLLM's field: the prefix cache shares stored prompt chunks only between requests of
    #: the same salt
    cache_salt: str | None = Field(None, min_length=1)
    #: add the generated ``token_ids`` to each choice (and ``prompt_token_ids`` to the response)
    return_token_ids: bool = False
    presence_penalty: float = Field(SamplingParams.presence_penalty, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                      allow_inf_nan=False)
    frequency_penalty: float = Field(SamplingParams.frequency_penalty, ge=-MAX_PENALTY, le=MAX_PENALTY,
                                       allow_inf_nan=False)
    #: token id (as a string, OpenAI's form) -> a bias of -100 to 100 added to its logit
    logit_bias: dict[str, float] | None = None
    #: vLLM's extensions: over the prompt and the answer (1: off)
    repetition_penalty: float = Field(SamplingParams.repetition_penalty, gt=0.0, allow_inf_nan=False)
    #: no end-of-sequence (or ``stop_token_ids``) token before this many tokens
    min_tokens: int = Field(GenerationParams.min_tokens, ge=0)
    #: tokens that end the answer as an end-of-sequence token does
    stop_token_ids: list[int] | None = None
    #: vLLM's: the text keeps the stop string that ended it; special tokens are shown
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    #: OpenAI's structured output: ``{"type": "text" | "json_object" | "json_schema",
    #: "json_schema": {"name", "schema", "strict"}}``
    response_format: ResponseFormat | None = None
    #: vLLM's guided decoding: a JSON schema, a regular expression, a list of choices or a
    #: grammar (Lark or GBNF)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: vLLM's newer form of the same: ``{"json" | "regex" | "choice" | "grammar": ...}`` or
    #: ``{"json_object": true}``
    structured_outputs: dict[str, Any] | None = None

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The form the answer must take and the field that asks for it (``response_format``,
        ``structured_outputs`` or a ``guided_*`` field; at most one may ask), or ``None``."""
        asked = []
        so = {k: v for k, v in (self.structured_outputs or {}).items() if v is not None and v is not False}
        other = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
        if other:
            raise APIError(400, f"structured_outputs: {', '.join(other)} is not supported by this server (json, "
                                "regex, choice, grammar and json_object are)", param="structured_outputs")
        if so.get("json_object"):
            asked.append(("structured_outputs", StructuredOutput(OutputFormat.JSON)))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutput(OutputFormat.JSON)))
        elif rf is not None and rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON object",
                               param="response_format")
            asked.append(("response_format", StructuredOutput.json_schema(schema)))
        for field, key, value in (("guided_json", "json", self.guided_json),
                                  ("guided_regex", "regex", self.guided_regex),
                                  ("guided_choice", "choice", self.guided_choice),
                                  ("guided_grammar", "grammar", self.guided_grammar)):
            for name, v in ((field, value), ("structured_outputs", so.get(key))):
                if v is None:
                    continue
                if key == "json" and isinstance(v, (dict, str)):
                    asked.append((name, StructuredOutput.json_schema(v)))
                elif key == "choice" and isinstance(v, list) and v and all(isinstance(c, str) for c in v):
                    asked.append((name, StructuredOutput.choice(v)))
                elif key in ("regex", "grammar") and isinstance(v, str):
                    form = OutputFormat.REGEX if key == "regex" else OutputFormat.GRAMMAR
                    asked.append((name, StructuredOutput(form, v)))
                else:
                    what = {"json": "a JSON schema", "choice": "a list of at least one string"}.get(key, "a string")
                    raise APIError(400, f"{name if name == field else 'structured_outputs.' + key} must be {what}",
                                   param=name)
        if len(asked) > 1:
            raise APIError(400, f"ask for one form of output, not {' and '.join(n for n, _ in asked)}",
                           param=asked[1][0])
        return asked[0] if asked else None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted ``(token, bias)`` pairs."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                pairs.append((int(key), float(bias)))
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        return tuple(sorted(pairs))

    def check_supported(self) -> None:
        """Raise a 400 :class:`APIError` when the request asks for an OpenAI feature this
        server does not provide (tools, best-of, a suffix): an answer that silently ignored
        it would not be what the client asked for. Fields at their neutral values
        (``tools: []``, ``tool_choice: "none"``) are accepted."""
        for name, value in (self.model_extra or {}).items():
            reason = _UNSUPPORTED.get(name)
            if reason is not None and asks_for(name, value):
                raise APIError(400, f"{name}: {reason} is not supported by this server", param=name)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must not be empty", param="stop")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> "_GenerationRequest":
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens

    def limit_field(self) -> str:
        """The field :meth:`token_limit` came from."""
        return "max_tokens"

    def logprob_count(self) -> int | None:
        """Alternatives per token to return with log probabilities (``None``: none)."""
        return None


#: OpenAI (and vLLM) request fields this server does not act on, with what they ask for
_UNSUPPORTED = {
    "suffix": "a suffix after the completion", "best_of": "best-of sampling",
    "tools": "tool calling (chat completions only)", "tool_choice": "tool calling (chat completions only)",
    "functions": "function calling (the legacy form; send tools)",
    "function_call": "function calling (the legacy form; send tool_choice)",
    "prompt_logprobs": "prompt_logprobs (on /v1/completions, echo with logprobs gives the prompt's)",
    "allowed_token_ids": "a list of allowed tokens (logit_bias can ban the others)",
    "bad_words": "banned words (logit_bias can ban their tokens)",
    "truncate_prompt_tokens": "prompt truncation", "guided_whitespace_pattern": "a whitespace pattern (a "
    "schema's x-guidance whitespace_pattern sets it)", "echo": "echo on chat completions",
    "max_completion_tokens": "max_completion_tokens on /v1/completions (send max_tokens)",
    # token limits by other APIs' names: ignored, the answer would run to the end of the context
    "max_output_tokens": "max_output_tokens outside /v1/responses (send max_tokens)",
    "max_new_tokens": "max_new_tokens (send max_tokens)",
    # output this server cannot make: refused, not answered with text alone
    "modalities": "output modalities other than text", "audio": "audio output",
}


def asks_for(name: str, value: Any) -> bool:
    """Whether ``value`` of the unsupported field ``name`` asks for anything (``None``,
    ``false``, empty, ``best_of`` or ``n`` 1 and ``tool_choice`` none or auto do not)."""
    if value is None or value is False or value == [] or value == {} or value == "":
        return False
    if name in ("best_of", "n"):
        return value != 1
    if name in ("tool_choice", "function_call"):
        return value not in ("none", "auto")
    if name == "modalities":
        return value != ["text"]
    return True


class ContentPart(BaseModel):
    """One part of a message's content list; only ``text`` parts carry words SoT reads."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a chat request, as OpenAI's chat completions API takes it."""
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    #: an assistant message's earlier calls (``[{"id", "type": "function", "function": {"name",
    #: "arguments"}}]``) and the call a ``tool`` message answers
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_where_needed(self) -> "ChatMessage":
        # (only an assistant's message may leave it out: one that made tool calls, say)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_dict(self) -> dict:
        """The message as the chat template reads it (text content; calls and ids where given)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return parts_text(self.content, "messages")


def parts_text(parts: list[ContentPart], param: str) -> str:
    """The text of a content list: its text parts joined; another kind of part, or a text part
    without text, is a 400 naming ``param``."""
    out = []
    for i, part in enumerate(parts):
        if part.type != "text":
            raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)", param=param)
        if part.text is None:
            raise APIError(400, f"content part {i} of type 'text' has no text", param=param)
        out.append(part.text)
    return "".join(out)


def checked_tools(tools: list[Any] | None, tool_choice: str | dict | None, parallel: bool = True) -> ToolUse:
    """A request's ``tools`` and ``tool_choice``, checked (a 400 naming the field otherwise)."""
    try:
        return ToolUse.of(tools or [], tool_choice, parallel)
    except ConfigError as exc:  # (its message begins with the field it is about)
        field = "tool_choice" if str(exc).startswith("tool_choice") else "tools"
        raise APIError(400, str(exc), param=field) from None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat in large part."""
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else parts_text(self.content, "prediction")


class ChatCompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/chat/completions``."""

    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1)
    #: text the answer is expected to repeat (a file to edit): drafted from, so it changes the
    #: speed, never the answer
    prediction: Prediction | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: functions the model may call (``[{"type": "function", "function": {"name",
    #: "description", "parameters"}}]``) and whether it must: ``none``, ``auto`` (the default
    #: with tools), ``required`` or ``{"type": "function", "function": {"name"}}`` (:mod:`sot.tools`)
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    #: more than one call in an answer (``False``: the first call only)
    parallel_tool_calls: bool = True
    #: vLLM's chat-template fields: end the prompt where the assistant's answer begins (or
    #: not), continue the last (assistant) message instead, and extra template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_setup(self) -> ToolUse:
        """The request's tools and tool choice, checked (a 400 naming the field otherwise)."""
        return checked_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """As for any request, or the form a ``required`` or named ``tool_choice`` holds the
        answer to (which cannot be combined with another form)."""
        asked = super().structured_output()
        use = self.tool_setup()
        calls = use.format()
        if calls is None:
            return asked
        if asked is not None:
            raise APIError(400, f"tool_choice {use.choice.mode!r} fixes the answer's form; leave out {asked[0]}",
                           param=asked[0])
        return "tool_choice", calls

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/completions``."""

    #: a text, token ids, or a list of either (one choice per prompt)
    prompt: str | list[int] | list[str] | list[list[int]]
    #: OpenAI's default for completions (a chat answer may run to the end of the context)
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: return the prompt before the completion (with ``logprobs``, its tokens' too); with
    #: ``max_tokens`` 0, the prompt alone (how evaluation harnesses score a text)
    echo: bool = False

    def logprob_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """``/tokenize``: a ``prompt``, or chat ``messages`` with any ``tools`` (vLLM's route)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """``/detokenize``: token ids to text (vLLM's route)."""

    model: str | None = None
    tokens: list[int]


#: the engine's finish reasons as the API gives them (``grammar``, a structured output whose
#: grammar allowed no token of the vocabulary, is vLLM's ``error``: the answer is incomplete)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "grammar": "error"}


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|literal|function-\w+)\[.*\])$")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter from pydantic's errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    # (pydantic names the member of a union it tried: "stop.str", "prompt.list[int]"; the
    # client's field is "stop", "prompt")
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_MEMBER.match(str(p))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")  # (a validator's own words)
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        if loc:
            return f"{param}: must be a JSON object", param
        return "the request body must be a JSON object", None
    return (f"{param}: {msg}" if param else msg), param


class ToolAnswer:
    """How one chat choice's text becomes content and tool calls, whole or streamed.

    With a named tool the text is the call's arguments and streams as argument deltas after
    a first delta with the call's id and name. With ``required`` the calls are sent once the
    answer is complete (a JSON list can't be split into calls before that). With ``auto``
    the text streams as content up to a ``<tool_call>`` tag, and what follows is read as calls
    at the end (or sent as content when it is not a call); an answer that opens with ``{`` or
    ``[`` may be a call written as bare JSON (Llama 3's and Mistral's form), so it is held
    back to the end too. ``include_stop``, ``skip_special`` and ``min_tokens`` are the request's,
    as for the choice's own text."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], use: ToolUse, include_stop: bool = False,
                 skip_special: bool = True, min_tokens: int = 0) -> None:
        self.use, self.choice = use, use.choice
        self._content = TextAssembler(tokenizer, stop, include_stop=include_stop, skip_special=skip_special,
                                      min_tokens=min_tokens, marks=(CALL_OPEN,)) if use.choice.mode == "auto" else None
        self.streamed = ""  # content sent so far (auto)
        self._held = ""  # the answer's opening, held while it may be a bare JSON call (auto)
        self.call_id = new_call_id()  # a named tool's call
        self._read: ReadAnswer | None = None

    def read(self, text: str) -> ReadAnswer:
        """The calls in the whole answer (a named call keeps the id its stream opened with)."""
        if self._read is None:
            read = self.use.read(text)
            if self.choice.mode == "named":
                read = ReadAnswer((), tuple(dataclasses.replace(c, id=self.call_id) for c in read.calls))
            self._read = read
        return self._read

    def first_delta(self) -> dict | None:
        """The delta that opens the stream's call (a named tool), or ``None``."""
        if self.choice.mode != "named":
            return None
        return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                "function": {"name": self.choice.name, "arguments": ""}}]}

    def delta(self, token_ids: list[int], text_delta: str, final: bool) -> dict | None:
        """The chat delta of one update (``text_delta``: its new answer text)."""
        if self.choice.mode == "named":
            return {"tool_calls": [{"index": 0, "function": {"arguments": text_delta}}]} if text_delta else None
        if self._content is None:
            return None
        d = self._content.add(token_ids, final)
        if not self.streamed:
            self._held += d
            head = self._held.lstrip()
            if not head or head[0] in "{[":  # (the end's delta sends it, as content or as calls)
                return None
            d, self._held = self._held, ""
        self.streamed += d
        return {"content": d} if d else None

    def last_delta(self, text: str) -> dict | None:
        """The delta that ends the stream: content not sent yet and every call (none for a
        named tool, whose arguments have streamed)."""
        if self.choice.mode == "named":
            return None
        read = self.read(text)
        out: dict = {}
        rest = "".join(read.pieces)[len(self.streamed):]
        if rest and (read.content is not None or self.streamed):
            out["content"] = rest
        if read.calls:
            out["tool_calls"] = [{"index": i, **c.to_openai()} for i, c in enumerate(read.calls)]
        return out or None

    def message(self, text: str) -> dict:
        """The whole answer's ``message``."""
        read = self.read(text)
        out = {"role": "assistant", "content": read.content}
        if read.calls:
            out["tool_calls"] = [c.to_openai() for c in read.calls]
        return out

    def finish_reason(self, text: str, reason: str) -> str:
        """``tool_calls`` where an ``auto`` or ``required`` answer ended with calls, else the
        engine's reason: a named tool's call ends with ``stop``, as OpenAI answers it."""
        if reason == "stop" and self.choice.mode != "named" and self.read(text).calls:
            return "tool_calls"
        return reason


class LogprobWriter:
    """The ``logprobs`` objects of one request's choice (or of each chunk of its stream): the
    tokens that make up the text returned so far, each with its log probability and
    alternatives, in the chat format (``{"content": [{"token", "logprob", "bytes",
    "top_logprobs"}]}``) or the completions one (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``). Tokens past a stop string, or that add no text (an
    end-of-sequence token), are not reported. ``text_offset`` counts from the start of the
    returned text, where ``offset`` characters (an echoed prompt) come before the answer."""

    def __init__(self, tokenizer: Any, chat: bool, offset: int = 0, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = offset  # characters before the answer in the returned text (an echoed prompt)
        self.entries: list[TokenLogprob] = []  # every generated token's, in order
        self.reported = 0
        self._decoded = IncrementalText(decoder(tokenizer, skip_special))  # (the returned text's decode)
        #: [n]: characters of the first n tokens' settled text (a character split across tokens
        #: counts once its last token is in, so each of its tokens is reported with it)
        self._lengths = [0]

    def add(self, entries: list[TokenLogprob]) -> None:
        self.entries.extend(entries)
        for e in entries:
            self._decoded.extend([e.token])
            self._lengths.append(self._decoded.settled_length)

    def _text_length(self, n: int) -> int:
        return self._lengths[n]

    def upto(self, chars: int) -> dict | None:
        """The object for the tokens not reported yet whose text lies within the first
        ``chars`` characters of the answer (``None`` when there are none)."""
        start, n = self.reported, self.reported
        while n < len(self.entries) and self._text_length(n) < chars:
            n += 1
        if n == start:
            return None
        self.reported = n
        return self._format(start, n)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _format(self, start: int, end: int) -> dict:
        entries = self.entries[start:end]
        if self.chat:
            def item(token: int, logprob: float) -> dict:
                s = self._piece(token)
                return {"token": s, "logprob": logprob, "bytes": list(token_bytes(self.tokenizer, token, s))}
            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in entries], "refusal": None}
        return {"tokens": [self._piece(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [_top_dict(self.tokenizer, e) for e in entries],
                "text_offset": [self.offset + self._text_length(i) for i in range(start, end)]}


def _top_dict(tokenizer: Any, entry: TokenLogprob) -> dict[str, float]:
    """The completions format's ``top_logprobs`` item: the token itself and its alternatives."""
    return {tokenizer.decode([t]): v for t, v in ((entry.token, entry.logprob),) + entry.top}


def prompt_logprobs_block(tokenizer: Any, prompt: list[int], entries: list[TokenLogprob | None]) -> dict:
    """The completions-format ``logprobs`` of an echoed prompt: its first token has none. A
    token's ``text_offset`` is where its share of the prompt's text begins (a character split
    over several byte tokens belongs to the last of them), so offsets follow the echoed text."""
    pieces = [tokenizer.decode([t]) for t in prompt]
    offsets, at = [], 0
    for share in token_pieces(tokenizer, prompt):
        offsets.append(at)
        at += len(share)
    return {"tokens": pieces, "token_logprobs": [e.logprob if e is not None else None for e in entries],
            "top_logprobs": [None if e is None else _top_dict(tokenizer, e) for e in entries],
            "text_offset": offsets}


def usage_of(prompt: list[int], result: SequenceResult | None, tokens: int) -> dict:
    """The OpenAI ``usage`` object (with ``prompt_tokens_details.cached_tokens``: prompt tokens
    taken from the prefix cache); ``tokens`` counts the answer when there is no result."""
    completion = result.new_tokens if result is not None else tokens
    cached = result.cached_tokens if result is not None else 0
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sot_figures(result: SequenceResult | None) -> dict | None:
    """SoT's figures of one request: mean accepted length (tau), steps, plain steps."""
    if result is None:
        return None
    drafted = sum(s - 1 for s in result.tree_sizes)
    accepted = sum(a - 1 for a in result.accept_lengths)
    return {"mean_accept_len": round(result.mean_accept_len, 4), "steps": result.steps,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "plain_steps": result.plain_steps}


def sse(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
