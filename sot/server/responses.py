"""OpenAI's Responses API (``POST /v1/responses``) as a translation of chat completions.

A Responses request (``input`` as a string or as items: messages, function calls and their
outputs; ``instructions``; flat function ``tools``; ``text.format``) becomes the chat
completion request it means, which runs through the same path as ``/v1/chat/completions``:
the same tokens, tools and structured output. The chat answer comes back as output items (a
``message`` with ``output_text``, ``function_call`` items), and a chat stream as the
Responses events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``).

A finished response is kept (``store``, true unless the request says false) in a bounded
:class:`ResponseStore`, so a later request can continue it with ``previous_response_id`` (its
conversation, then the new input; the earlier ``instructions`` are not carried over, as
OpenAI does it), and ``GET`` / ``DELETE /v1/responses/{id}`` read or drop it. The prefix
cache reads the repeated conversation once, so a continuation costs its new tokens.
"""
from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field

from sot.sampling import MAX_TOP_LOGPROBS
from sot.server.config import RESPONSES_KEPT
from sot.server.protocol import APIError, NullMeansDefault, asks_for

#: Responses fields this server does not act on, with what they ask for
_UNSUPPORTED = {
    "conversation": "stored conversations", "reasoning": "reasoning settings", "background": "background responses",
    "prompt": "stored prompt templates", "max_tool_calls": "a tool-call limit",
    # other APIs' names for what a Responses request calls otherwise (ignored, the answer would
    # run to the end of the context, or come back once)
    "max_tokens": "max_tokens on /v1/responses (send max_output_tokens)",
    "max_completion_tokens": "max_completion_tokens on /v1/responses (send max_output_tokens)",
    "max_new_tokens": "max_new_tokens (send max_output_tokens)",
    "n": "several answers to one request (n) on /v1/responses",
}
#: the ``include`` value that asks for the answer's log probabilities (the only one this server gives)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: chat-completion extensions a Responses request may carry as they are
_PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
           "stop", "ignore_eos", "sampling_mode", "min_tokens", "stop_token_ids", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "chat_template_kwargs", "priority", "include_stop_str_in_output",
           "skip_special_tokens", "structured_outputs",
           # (refused by name there, as on the chat route)
           "prompt_logprobs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "guided_whitespace_pattern")

#: the error of a response the server stopped before it finished (``finish_reason`` abort)
ABORTED = "the server stopped this response before it finished (it is shutting down); send the request again"
#: the error of a response whose ``text.format`` allowed no token of the model's vocabulary
DEAD_END = ("the answer stopped short of text.format: its grammar allowed no token of this model's vocabulary "
            "(a character no token spells?)")
#: chat-completion fields and the Responses fields they come from (named in errors)
_CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def responses_error(exc: APIError) -> APIError:
    """``exc``, raised for the chat completion a Responses request became, naming the
    Responses request's own fields."""
    param = _CHAT_FIELDS.get(exc.param, exc.param) if exc.param else exc.param
    message = exc.message.replace("max_completion_tokens", "max_output_tokens")
    message = message.replace("response_format json_schema needs json_schema.schema", "text.format json_schema needs "
                              "schema").replace("response_format", "text.format")
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers, counted=exc.counted)


class ResponsesRequest(NullMeansDefault):
    """The fields of a Responses request that SoT reads (others are refused by name or,
    like ``metadata`` and ``store``, answered as given)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # (the served model when left out)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    user: str | None = None
    #: vLLM's field, as on the chat route: prefix-cache chunks are shared only under one salt
    cache_salt: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    #: extra output: ``message.output_text.logprobs`` (each answer token's log probability)
    include: list[str] | None = None
    #: alternatives given with each token's log probability (0-20)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_supported(self) -> None:
        """Refuse what this server does not do, and ``metadata`` OpenAI would refuse."""
        truncation = (self.model_extra or {}).get("truncation")
        if truncation not in (None, "disabled"):
            raise APIError(400, "truncation: this server does not drop input to fit the context (only 'disabled'); "
                                "shorten the input", param="truncation")
        metadata = self.metadata or {}
        if len(metadata) > 16 or any(not isinstance(v, str) or len(v) > 512 or len(k) > 64
                                     for k, v in metadata.items()):
            raise APIError(400, "metadata: at most 16 pairs, keys of up to 64 characters and string values of up "
                                "to 512", param="metadata")
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and asks_for(name, value):
                raise APIError(400, f"{name}: {_UNSUPPORTED[name]} is not supported by this server", param=name)
        other = [item for item in self.include or [] if item != LOGPROBS_INCLUDE]
        if other:
            raise APIError(400, f"include: {', '.join(other)} is not supported by this server (it gives "
                                f"{LOGPROBS_INCLUDE})", param="include")

    @property
    def wants_logprobs(self) -> bool:
        """Whether the answer's tokens come with log probabilities (``include`` asks for them, or
        ``top_logprobs`` is set)."""
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def chat_body(self, history: list[dict] | None = None) -> dict:
        """The chat completion request this one means; ``history``: the chat messages of the
        conversation it continues (``previous_response_id``), put before its input."""
        self.check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += list(history or []) + self.input_messages()
        body: dict = {"model": self.model, "messages": messages, "temperature": self.temperature,
                      "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls, "user": self.user}
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "answer"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise APIError(400, "text.format must be {type: text}, {type: json_object} or "
                                "{type: json_schema, name, schema}", param="text")
        for name in _PASSED:
            if name in (self.model_extra or {}):
                body[name] = self.model_extra[name]
        return body

    def input_messages(self) -> list[dict]:
        """The ``input`` as chat messages (without the ``instructions``)."""
        messages: list[dict] = []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise APIError(400, f"{where}: a message's role must be user, system, developer or assistant",
                                   param="input")
                messages.append({"role": role, "content": _text_of(item.get("content"), where)})
            elif kind == "function_call":
                for field in ("call_id", "name", "arguments"):
                    if not isinstance(item.get(field), str):
                        raise APIError(400, f"{where}: a function_call item needs {field} (a string)", param="input")
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or "output" not in item:
                    raise APIError(400, f"{where}: a function_call_output item needs call_id (a string) and output",
                                   param="input")
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, "
                                    "function_call and function_call_output are)", param="input")
        if not messages:
            raise APIError(400, "input holds no message", param="input")
        return messages


def _text_of(content: Any, where: str) -> str:
    """The text of a Responses message's content (a string or text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}: content parts of type {kind!r} are not supported (text only)",
                           param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_tool(tool: dict, i: int) -> dict:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only tools of type 'function' are supported", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---------------------------------------------------------------------------- answers
class ResponseBuilder:
    """The Responses object of one request, whole or built from a chat stream's chunks."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.id = "resp_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.output: list[dict] = []
        self.sequence = 0
        self._message: dict | None = None  # the message item being streamed
        self._calls: dict[int, dict] = {}  # chat tool-call index -> function_call item being streamed
        self.finish: str | None = None  # the chat finish reason, once streamed
        self.figures: dict | None = None  # SoT's figures, once streamed
        #: whether the finished response is kept (a store exists and the request allows it)
        self.stored = False
        #: the finished response, once :meth:`whole` or :meth:`closing` built it
        self.done: dict | None = None

    def response(self, status: str, usage: dict | None = None, finish: str | None = None,
                 figures: dict | None = None, error: str | None = None) -> dict:
        """The response object; a ``completed`` one is ``incomplete`` when the chat ``finish``
        reason is ``length`` and ``failed`` when it is ``abort`` (the server stopped it) or an
        ``error`` message is given. A failed response is not kept."""
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        if status == "completed" and (finish in ("abort", "error") or error is not None):
            status, incomplete = "failed", None
            error = error or (ABORTED if finish == "abort" else DEAD_END)
        elif status == "completed" and incomplete:
            status = "incomplete"
        if status == "failed":
            self.stored = False
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": r.model, "output": self.output,
            "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature, "top_p": r.top_p,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [], "text": r.text or {"format": {"type": "text"}}, "metadata": r.metadata or {},
            "store": self.stored, "previous_response_id": r.previous_response_id,
            "top_logprobs": r.top_logprobs or 0, "usage": _usage(usage) if usage else None, "user": r.user,
            "truncation": "disabled",
        }
        if figures is not None:
            out["sot"] = figures
        return out

    def whole(self, chat: dict) -> dict:
        """The response of a whole chat completion."""
        choice = chat["choices"][0]
        message = choice["message"]
        status = _item_status(choice["finish_reason"])
        if message.get("content"):
            self.output.append(_message_item("msg_" + secrets.token_hex(12), message["content"], status,
                                             _token_logprobs(choice)))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            self.output.append(_call_item(call["id"], fn["name"], fn["arguments"], status))
        self.done = self.response("completed", chat.get("usage"), choice["finish_reason"], chat.get("sot"))
        return self.done

    # -- streaming
    def event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def on_chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat stream chunk (content and tool-call deltas)."""
        events: list[dict] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], _token_logprobs(choice))
            for d in delta.get("tool_calls") or []:
                events += self._call(d)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.figures = chunk.get("sot")
        return events

    def _text(self, text: str, logprobs: list[dict]) -> list[dict]:
        events = []
        if self._message is None or self._message["status"] != "in_progress":
            events += self._close_open("completed")
            self._message = _message_item("msg_" + secrets.token_hex(12), "", "in_progress")
            self._message["content"] = []
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=dict(self._message)))
            self._message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            events.append(self.event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                     content_index=0, part=dict(self._message["content"][0])))
        self._message["content"][0]["text"] += text
        self._message["content"][0]["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self._message["id"],
                                 output_index=self.output.index(self._message), content_index=0, delta=text,
                                 logprobs=logprobs))
        return events

    def _call(self, d: dict) -> list[dict]:
        events = []
        fn = d.get("function") or {}
        item = self._calls.get(d.get("index", 0))
        if item is None:  # a new item: the ones before it are done (OpenAI streams one item at a time)
            events += self._close_open("completed")
            item = _call_item(d.get("id") or "call_" + secrets.token_hex(12), fn.get("name") or "", "", "in_progress")
            self._calls[d.get("index", 0)] = item
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=fn["arguments"]))
        return events

    def _close_open(self, status: str) -> list[dict]:
        """The events that close the items still open, each with ``status``."""
        events = []
        for index, item in enumerate(self.output):
            if item["status"] != "in_progress":
                continue
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=part["logprobs"]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=dict(part)))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def closing(self, usage: dict | None, error: str | None = None) -> list[dict]:
        """The events that close every open item and the response (``response.completed``,
        ``.incomplete`` or ``.failed``; ``error``: why the chat stream failed)."""
        events = self._close_open("incomplete" if error else _item_status(self.finish))
        done = self.done = self.response("completed", usage, self.finish, self.figures, error)
        return events + [self.event(f"response.{done['status']}", response=done)]


def _item_status(finish: str | None) -> str:
    """An output item's status at the end of a chat answer that ended for ``finish``."""
    return "incomplete" if finish in ("length", "abort", "error") else "completed"


# ---------------------------------------------------------------------------- the store
@dataclass
class _Kept:
    response: dict  # the response object, as answered
    turn: list[dict]  # this request's input and its answer as chat messages (after those of evicted turns before it)
    previous: str | None  # the kept response it continues
    items: list[dict]  # this request's input, as Responses items with ids


class ResponseStore:
    """The last ``capacity`` finished responses, for ``previous_response_id`` and ``GET`` /
    ``DELETE /v1/responses/{id}``. Each keeps only its own turn (its input and answer) and
    the id it continued, so a long conversation is stored once; reading one back walks the
    chain. The least recently used response goes first; its turn moves into the kept
    responses that continue it, so a conversation stays whole while any of its later turns is
    kept (continuing a turn uses the turns before it too, and the latest turn last)."""

    def __init__(self, capacity: int = RESPONSES_KEPT) -> None:
        if capacity < 1:
            raise ValueError(f"a response store keeps at least 1 response, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict, request: ResponsesRequest, history: list[dict] | None = None) -> None:
        """Keep a finished ``response`` to ``request`` (its input and output as the turn);
        ``history``: the conversation it continued, as read when it started, which becomes part
        of its turn if the response it continued was evicted meanwhile."""
        turn = request.input_messages() + _assistant_messages(response["output"])
        previous = request.previous_response_id
        if previous is not None and previous not in self._kept and history is not None:
            turn, previous = list(history) + turn, None
        self._kept[response["id"]] = _Kept(response, turn, previous, _input_items(request.input))
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self.capacity:
            rid, gone = self._kept.popitem(last=False)
            for kept in self._kept.values():
                if kept.previous == rid:
                    kept.turn, kept.previous = gone.turn + kept.turn, gone.previous

    def get(self, rid: str) -> dict:
        """The response object kept under ``rid`` (a 404 when it is not kept)."""
        return self._find(rid).response

    def input_items(self, rid: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """OpenAI's list of the input items of response ``rid``: ``limit`` of them (1 to
        100), newest first (``order`` ``desc``) or oldest first (``asc``), from the item after
        ``after``."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be in 1..100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")
        items = self._find(rid).items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: response {rid!r} has no input item {after!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, rid: str) -> None:
        self._find(rid)
        del self._kept[rid]

    def history(self, rid: str) -> list[dict]:
        """The chat messages of the conversation up to and including response ``rid``'s
        answer, oldest first (a 404 names a response, or an earlier one of its chain, that is
        not kept)."""
        chain, at = [], rid
        while at is not None:
            try:
                kept = self._find(at, param="previous_response_id")
            except APIError:
                if at == rid:
                    raise
                raise APIError(404, f"response {rid!r} continues {at!r}, which was deleted",
                               param="previous_response_id", code="not_found") from None
            chain.append(at)
            at = kept.previous
        for at in reversed(chain):  # used oldest to newest: the turn continued is the most recent
            self._kept.move_to_end(at)
        return [message for at in reversed(chain) for message in self._kept[at].turn]

    def _find(self, rid: str, param: str | None = None) -> _Kept:
        kept = self._kept.get(rid)
        if kept is None:
            raise APIError(404, f"no response with id {rid!r} is kept (responses stored with store: false, "
                                "deleted or past the server's --responses-kept are not)", param=param,
                           code="not_found")
        self._kept.move_to_end(rid)
        return kept


_ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def _input_items(given: str | list[dict]) -> list[dict]:
    """A request's ``input`` as Responses items, each with an id (a message's text as parts)."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        item.setdefault("id", _ITEM_PREFIX.get(kind, "item_") + secrets.token_hex(12))
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("status", "completed")
        out.append(item)
    return out


def _assistant_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant's chat message (its text and calls)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item.get("content", []))
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _token_logprobs(choice: dict) -> list[dict]:
    """A chat choice's (or chunk's) token log probabilities, in the Responses form: the same
    ``{token, logprob, bytes, top_logprobs}`` entries as the chat ``logprobs.content``."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(chat: dict) -> dict:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def sse_event(event: dict) -> str:
    """One Responses server-sent event (``event:`` names its type, as OpenAI sends them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

