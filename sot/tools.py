"""Tool (function) calling: the tools in the prompt, the form a call must take, and the calls
read back from an answer.

A request lists tools in OpenAI's form (``{"type": "function", "function": {"name",
"description", "parameters"}}``) and a ``tool_choice``:

* ``none``: the model answers in text; the tools are left out of the prompt.
* ``auto`` (the default with tools): the model decides. Calls are read back from the answer
  when it writes them as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (the format of Hermes, Qwen and SmolLM3 templates, and the one SoT describes to models whose
  template knows no tools), or as a whole answer that is one such JSON object (Llama 3.x) or
  a JSON list of them (Mistral, whose ``[TOOL_CALLS]`` marker is a special token, left out
  of the text).
* ``required``: the answer is held by a grammar to a JSON list of one or more calls
  (``[{"name", "arguments"}]``), each call's arguments to its tool's parameter schema.
* a named function (``{"type": "function", "function": {"name": ...}}``): the answer is held
  to that tool's parameter schema and is the call's arguments.

A grammar only removes tokens the form does not allow (:mod:`sot.structured`), so an answer
with tools is still exactly plain decoding's under the same rules.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from sot.errors import ConfigError
from sot.structured import StructuredOutput

#: the tags around a call in an answer (and in the prompt SoT writes for template-less models)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: the tags around a tool's result in that prompt
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
#: OpenAI's rule for function names
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: tools one request may list
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    """One function the model may call. ``parameters``: a JSON schema of its arguments, as
    JSON text (so the tool is hashable)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def schema(self) -> dict:
        return json.loads(self.parameters)

    def to_openai(self) -> dict:
        """OpenAI's form, which chat templates read too."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema()}}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: ``none``, ``auto``, ``required`` or ``named`` (then ``name`` is the tool)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class ToolCall:
    """One call read from an answer; ``arguments`` is JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's form, ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    """Tools from OpenAI's ``tools`` list; a :class:`ConfigError` beginning with ``tools``
    names what is wrong."""
    if not isinstance(raw, list):
        raise ConfigError("tools must be a list of {type: function, function: {name, description, parameters}}")
    if len(raw) > MAX_TOOLS:
        raise ConfigError(f"tools lists {len(raw)} tools; at most {MAX_TOOLS} are allowed")
    tools = []
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ConfigError(f"{where}: only tools of type 'function' are supported")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ConfigError(f"{where}: needs a 'function' object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ConfigError(f"{where}: the function name must be 1-64 letters, digits, '_' or '-', "
                              f"got {name!r}")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ConfigError(f"{where}: the description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: parameters must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise ConfigError(f"{where}: parameters must describe an object (type: object), since a call's "
                              f"arguments are a JSON object; got type {params['type']!r}")
        if "type" not in params:  # ({}, bare properties, a $ref or anyOf: the arguments are still an object)
            params = {"type": "object", **params}
        problem = _schema_problem(params)
        if problem:
            hint = " (no JSON object fits it, and a call's arguments are one)" if "Unsatisfiable" in problem else ""
            raise ConfigError(f"{where}: parameters of {name!r} are not a usable JSON schema: {problem}{hint}")
        tools.append(Tool(name, description, json.dumps(params)))
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"tools: function names must be unique; {', '.join(repeated)} appear more than once")
    return tuple(tools)


def _schema_problem(schema: dict) -> str:
    """Why a JSON schema cannot be compiled to a grammar ("" when it can)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(StructuredOutput.json_schema(schema).grammar(), None)
    except ConfigError as exc:
        return str(exc)


def parse_tool_choice(raw: Any, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's ``tool_choice`` (``None``: ``auto`` with tools, ``none`` without); a
    :class:`ConfigError` beginning with ``tool_choice`` says what is wrong."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ConfigError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {raw!r}")
        if raw == "required" and not tools:
            raise ConfigError("tool_choice 'required' needs tools")
        return ToolChoice(raw if tools else "none")
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ConfigError("tool_choice must be 'none', 'auto', 'required' or "
                          "{type: function, function: {name}}")
    if name not in {t.name for t in tools}:
        raise ConfigError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolChoice("named", name)


def call_format(tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True) -> StructuredOutput | None:
    """The form the answer must take: a named tool's parameter schema, a JSON list of calls
    for ``required`` (one call at most unless ``parallel``), nothing otherwise."""
    if choice.mode == "named":
        return StructuredOutput.json_schema(next(t for t in tools if t.name == choice.name).parameters)
    if choice.mode != "required":
        return None
    # each tool's schema sits whole under $defs, its local references moved there with it (a
    # "#/$defs/..." of a nested Pydantic model, "#" of a recursive one), and arguments refer to it
    defs = {f"tool{i}": _moved_refs(_without_id(t.schema()), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    one_of = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
               "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


def _without_id(schema: Any) -> Any:
    """A tool's schema without its own ``$id`` and ``$schema``: moved under the list's ``$defs``,
    an ``$id`` would make its references resolve against it rather than the whole schema."""
    if not isinstance(schema, dict):
        return schema
    return {k: v for k, v in schema.items() if k not in ("$id", "$schema")}


def _moved_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``) pointing below ``base`` instead of the root."""
    if isinstance(schema, list):
        return [_moved_refs(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _moved_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


# ---------------------------------------------------------------------------- the prompt
def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any("tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


def tool_instructions(tools: Sequence[Tool]) -> str:
    """What SoT tells a model whose chat template knows no tools: the tools and the call
    format that :func:`read_calls` reads back."""
    listed = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return ("You may call the functions below to answer. Each is described by a JSON schema:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, answer with its name and arguments as a JSON object between tags, "
            "one call per block:\n"
            f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CALL_CLOSE}')


def chat_messages(messages: Sequence[dict], tools: Sequence[Tool], tokenizer: Any,
                  system: bool = True) -> tuple[list[dict], dict]:
    """Messages and ``apply_chat_template`` keyword arguments for a chat with ``tools``.

    ``messages`` are OpenAI's (an assistant message may carry ``tool_calls``, a ``tool``
    message answers one). A template that knows tools gets them as they are, with each call's
    arguments as an object. For one that does not, SoT writes the tools into the system
    message, an earlier call as a ``<tool_call>`` block in its assistant message, and tool
    results as a user message of ``<tool_response>`` blocks. Without ``system`` (for a
    template that refuses a system message, as Gemma 2's) the system text, SoT's included,
    opens the first user message instead."""
    native = supports_tools(tokenizer)
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m["tool_calls"] = [_call_with_object(c) for c in calls]
            out.append(m)
            continue
        if m.get("role") == "tool":
            block = f"{RESULT_OPEN}\n{m.get('content') or ''}\n{RESULT_CLOSE}"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        if calls:
            blocks = [f"{CALL_OPEN}\n{json.dumps(_call_with_object(c)['function'], ensure_ascii=False)}\n{CALL_CLOSE}"
                      for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            m.pop("tool_calls")
        out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("_results", None)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": [t.to_openai() for t in tools]}
    text = tool_instructions(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    if not system and len(out) > 1 and out[1]["role"] == "user":
        head = out.pop(0)
        out[0] = {**out[0], "content": f"{head['content']}\n\n{out[0]['content']}"}
    return out, {}


def _call_with_object(call: Any) -> dict:
    """An OpenAI tool call with its ``arguments`` as an object where they are JSON text (most
    templates write them with ``tojson``)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ConfigError("tool_calls: each call needs {type: function, function: {name, arguments}}")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ConfigError(f"tool_calls: the arguments of {fn.get('name')!r} are not JSON: {args[:80]!r}") from None
    return {**call, "type": "function", "function": {"name": fn.get("name"), "arguments": fn.get("arguments", {})}}


# ---------------------------------------------------------------------------- reading calls back
@dataclass(frozen=True)
class ReadAnswer:
    """An answer read for tool calls: ``pieces`` are its text outside the calls, in order
    (``content`` joins them; ``None`` when only whitespace is left)."""

    pieces: tuple[str, ...]
    calls: tuple[ToolCall, ...]

    @property
    def content(self) -> str | None:
        text = "".join(self.pieces)
        return text if text.strip() else None


def read_calls(text: str, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True) -> ReadAnswer:
    """The calls in an answer and the text around them. Text that does not parse as calls of
    the listed tools stays text (a block naming an unknown function). An answer cut short by
    ``max_tokens`` keeps the calls it wrote whole and drops the one it was writing; one cut
    before its first call ends stays text."""
    names = {t.name for t in tools}
    as_text = ReadAnswer((text,), ())
    if choice.mode == "none" or not tools:
        return as_text
    if choice.mode == "named":
        return ReadAnswer((), (ToolCall(choice.name, text, new_call_id()),))
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # (held to the grammar, so cut short: the calls it completed)
            items = _complete_items(text)
        calls = [_to_call(item, names) for item in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls):
            return as_text
        return ReadAnswer((), tuple(calls[: None if parallel else 1]))
    # auto: <tool_call> blocks, or a whole answer that is one call or a list of calls
    if CALL_OPEN not in text:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                return as_text
            calls = [_to_call(v, names) for v in (value if isinstance(value, list) else [value])]
            if calls and all(c is not None for c in calls):
                return ReadAnswer((), tuple(calls[: None if parallel else 1]))
        return as_text
    pieces, calls, at = [], [], 0
    while True:
        start = text.find(CALL_OPEN, at)
        if start < 0:
            tail = text[at:]
            if calls and tail.strip() and CALL_OPEN.startswith(tail.strip()):
                tail = ""  # the opening of one more call, cut by the length limit: no content
            pieces.append(tail)
            break
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN): end if end >= 0 else len(text)]
        try:
            call = _to_call(json.loads(body), names)
        except json.JSONDecodeError:
            call = None
        if call is None and end < 0 and calls:  # (one more call, cut by the length limit: dropped)
            pieces.append(text[at:start])
            break
        if call is None:
            return as_text
        pieces.append(text[at:start])
        calls.append(call)
        if end < 0:
            break
        at = end + len(CALL_CLOSE)
    return ReadAnswer(tuple(p for p in pieces if p), tuple(calls[: None if parallel else 1]))


def _complete_items(text: str) -> list:
    """The items of a JSON list cut short (``[{...}, {...}, {"na``) that were written whole,
    in order; none when ``text`` does not open a list."""
    decoder, items = json.JSONDecoder(), []
    at = len(text) - len(text.lstrip())
    if text[at: at + 1] != "[":
        return items
    at += 1
    while True:
        while at < len(text) and (text[at].isspace() or (items and text[at] == ",")):
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _to_call(item: Any, names: set[str]) -> ToolCall | None:
    """A call from ``{"name", "arguments"}`` (or Llama's ``"parameters"``) naming a listed tool."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(item["name"], text, new_call_id())


# ---------------------------------------------------------------------------- one request's tools
@dataclass(frozen=True)
class ToolUse:
    """The tools offered with a generation, how they may be called and whether more than
    one call is read from an answer: what :meth:`sot.api.SoT.generate` and ``sot generate
    --tools`` use."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True

    @classmethod
    def of(cls, tools: Any, tool_choice: Any = None, parallel: bool = True) -> "ToolUse":
        """From OpenAI's ``tools`` list and ``tool_choice`` (a :class:`ConfigError` names what is wrong)."""
        offered = parse_tools(tools)
        return cls(offered, parse_tool_choice(tool_choice, offered), parallel)

    def offered(self) -> list[dict]:
        """The tools as the prompt offers them, in OpenAI's form (none with ``tool_choice`` none);
        :func:`sot.prompts.with_tools` puts them beside a prompt's messages."""
        return [t.to_openai() for t in self.tools] if self.choice.calls_tools else []

    def format(self) -> StructuredOutput | None:
        """The form the answer must take (:func:`call_format`)."""
        return call_format(self.tools, self.choice, self.parallel)

    def read(self, text: str) -> ReadAnswer:
        """The calls in an answer and the text around them (:func:`read_calls`)."""
        return read_calls(text, self.tools, self.choice, self.parallel)
