"""Prompt inputs: plain strings or JSONL records, rendered to token ids."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, Union

from jinja2 import TemplateError

from sot.errors import ConfigError
from sot.tools import chat_messages, parse_tools

PromptItem = Union[str, dict]

#: request settings a prompt line may carry by habit (OpenAI's batch lines, vLLM's requests);
#: a prompts file sets none of them: every prompt takes the command's settings
LINE_SETTINGS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                 "stop", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                 "response_format", "tool_choice", "ignore_eos")


def json_lines(path: str | Path, missing: str = "prompts file not found") -> list[tuple[int, Any]]:
    """``(line number, parsed value)`` for each non-blank line of a JSONL file (``-``: standard
    input); a missing file or a line that is not JSON is a :class:`ConfigError` naming the place."""
    p = Path(path)
    try:
        if str(path) == "-":  # standard input
            text = sys.stdin.buffer.read().decode("utf-8-sig")
        elif p.exists() and not p.is_dir():  # (a pipe such as /dev/stdin too)
            text = p.read_bytes().decode("utf-8-sig")  # (a leading byte-order mark is not part of the text)
        elif p.is_dir():
            raise ConfigError(f"{path} is a folder, not a JSONL file")
        else:
            raise ConfigError(f"{missing}: {path}")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Read prompt records, one JSON object per line: ``{"prompt": str}``,
    ``{"messages": [...]}`` (with ``"tools": [...]`` if it offers functions) or
    ``{"turns": [str, ...]}`` (the first turn is used)."""
    records, settings = [], {}
    for number, record in json_lines(path):
        check_record(record, f"{path}:{number}")
        for text in _texts(record):
            check_utf8(text, f"{path}:{number}: the text")
        records.append(record)
        for key in LINE_SETTINGS if isinstance(record, dict) else ():
            if key in record:
                settings.setdefault(key, number)
    if not records:
        raise ConfigError(f"{path} holds no prompts")
    if settings:
        named = ", ".join(f"{k} (line {n})" for k, n in settings.items())
        warnings.warn(f"{path}: settings on prompt lines are not read: {named}; every prompt takes the "
                      "command's settings (--max-new-tokens, --temperature, ...)", stacklevel=2)
    return records


def _texts(record: Any) -> list[str]:
    """The strings a checked prompt record holds (its prompt, turns, system and messages)."""
    if isinstance(record, str):
        return [record]
    out = [record[k] for k in ("prompt", "system") if isinstance(record.get(k), str)]
    out += [t for t in record.get("turns") or [] if isinstance(t, str)]
    out += [m["content"] for m in record.get("messages") or []
            if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return out


def check_record(record: Any, where: str = "prompt") -> None:
    """Raise :class:`ConfigError` unless ``record`` is a string or a known prompt object."""
    if isinstance(record, str):
        return
    if not isinstance(record, dict):
        hint = ""
        if isinstance(record, (list, tuple)) and record and all(isinstance(m, dict) for m in record):
            hint = ' (a chat goes as {"messages": [...]})'
        elif isinstance(record, (list, tuple)) and where == "prompt":  # (the library's caller, not a file's line)
            hint = " (token ids go to SoT.generate_ids; AsyncSoT takes one prompt a call)"
        raise ConfigError(f"{where}: expected a string or a JSON object, got {type(record).__name__}{hint}")
    if isinstance(record.get("prompt"), str):
        return
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and ("content" in m or "tool_calls" in m) for m in messages):
        return
    turns = record.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        if not isinstance(record.get("system", ""), str):
            raise ConfigError(f"{where}: 'system' must be a string")
        return
    raise ConfigError(f"{where}: needs 'prompt' (string), 'messages' (list of {{role, content}}) or 'turns' (list of strings)")


def check_utf8(text: str, where: str = "the text") -> str:
    """``text``, or a :class:`ConfigError` if it holds bytes that are not UTF-8 (Python keeps
    such bytes of a command line or a terminal's input as lone surrogates, which no tokenizer
    can read)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"the byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise ConfigError(f"{where} is not valid UTF-8 ({what} at character {exc.start})") from None
    return text


def to_messages(item: PromptItem) -> list[dict] | None:
    """The chat messages of an item, or ``None`` for a raw completion prompt."""
    if isinstance(item, str):
        return [{"role": "user", "content": item}]
    if "messages" in item:
        return list(item["messages"])
    if "turns" in item:
        return [{"role": "user", "content": item["turns"][0]}]
    return [{"role": "user", "content": item["prompt"]}]


def with_tools(item: PromptItem, tools: list[dict]) -> dict:
    """A prompt as a chat record that offers ``tools`` (OpenAI's function list; none: no
    ``tools`` key; see :mod:`sot.tools`)."""
    check_record(item)
    out: dict = {"messages": to_messages(item)}
    if tools:
        out["tools"] = tools
    return out


def to_text(item: PromptItem) -> str:
    """The raw text of an item, for models or runs without a chat template."""
    if isinstance(item, str):
        return item
    if "prompt" in item:
        return item["prompt"]
    if "turns" in item:
        return item["turns"][0]
    return "\n".join(_content_text(m.get("content")) for m in item["messages"])


def _content_text(content: Any) -> str:
    """A message's text: its string, or the text of its parts (OpenAI's
    ``[{"type": "text", "text": ...}]``); none for a message without content (a tool call)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, (str, dict))]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise ConfigError("a message's content must be a string or a list of text parts "
                      '([{"type": "text", "text": ...}])')


def encode(tokenizer: Any, item: PromptItem, chat: bool, generation_prompt: bool = True,
           continue_final: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one prompt; with ``chat`` the tokenizer's chat template is applied (with
    the item's ``tools``, OpenAI's function list, where it has them: :mod:`sot.tools`).

    ``generation_prompt`` ends the prompt where the assistant's answer begins;
    ``continue_final`` leaves the last (assistant) message open so that the answer continues
    it; ``template_kwargs`` go to the template (``enable_thinking``, ...) and, as vLLM's
    ``chat_template_kwargs`` do, override those two where they hold ``add_generation_prompt``
    or ``continue_final_message``. A template that cannot render the messages is a
    :class:`ConfigError` with its reason."""
    check_record(item)
    template_kwargs = dict(template_kwargs or {})
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in template_kwargs and not isinstance(template_kwargs[name], bool):
            raise ConfigError(f"chat_template_kwargs.{name} must be true or false, got {template_kwargs[name]!r}")
    generation_prompt = template_kwargs.pop("add_generation_prompt", generation_prompt)
    continue_final = template_kwargs.pop("continue_final_message", continue_final)
    if not chat:
        return list(tokenizer(check_utf8(to_text(item)))["input_ids"])
    messages, extra = to_messages(item), {}
    for m in messages:
        if isinstance(m.get("content"), str):
            check_utf8(m["content"])
    tools = isinstance(item, dict) and (item.get("tools") or any(m.get("role") == "tool" or m.get("tool_calls")
                                                                for m in messages))
    if continue_final and (not messages or messages[-1].get("role") != "assistant"):
        raise ConfigError("continue_final_message needs the last message to be the assistant's")
    if continue_final and generation_prompt:
        raise ConfigError("continue_final_message and add_generation_prompt cannot both be true")
    kwargs = dict(template_kwargs, add_generation_prompt=generation_prompt, tokenize=True)
    if continue_final:
        kwargs["continue_final_message"] = True
    attempts = [True, False] if tools else [True]  # (a template may refuse a system message)
    for system in attempts:
        if tools:
            messages, extra = chat_messages(to_messages(item), parse_tools(item.get("tools") or []), tokenizer,
                                            system=system)
        try:
            out = tokenizer.apply_chat_template(messages, **kwargs, **extra)
            break
        except (TemplateError, ValueError, TypeError) as exc:
            error = exc
    else:
        raise ConfigError(f"the chat template cannot render these messages: {error}")
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def read_chat_template(template: str) -> str:
    """A chat template's Jinja text from ``template``: the text itself, or a file holding it;
    a template that is not valid Jinja is a :class:`ConfigError` (found before a model loads)."""
    if "{{" in template or "{%" in template:
        text = template
    else:
        path = Path(template)
        if path.is_dir():
            raise ConfigError(f"chat template {template}: is a folder; give the template's file or its text")
        if not path.is_file():
            raise ConfigError(f"chat template: no such file, and not a Jinja template: {template}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"chat template {template}: cannot be read as UTF-8 text ({exc})") from None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # (the environment transformers renders templates in)
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateError as exc:
        raise ConfigError(f"chat template: not valid Jinja: {exc}") from None
    return text


def use_chat_template(tokenizer: Any, template: str) -> None:
    """Give ``tokenizer`` the chat template ``template`` (Jinja text, or a file holding it),
    as vLLM's ``--chat-template`` does; one that cannot render a one-message chat is a
    :class:`ConfigError`."""
    tokenizer.chat_template = read_chat_template(template)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError, TypeError) as exc:
        raise ConfigError(f"chat template: it cannot render a one-message chat: {exc}") from None


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (its own or one set with ``--chat-template``)."""
    return bool(getattr(tokenizer, "chat_template", None))
