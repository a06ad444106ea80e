"""``sot generate``, ``sot chat``, ``sot trace`` and ``sot score``."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sot.cli.common import (
    add_adapt_args, add_chat_flag, add_drafter_args, add_model_args, add_sampling_args, check_distinct_files,
    check_output_path, load_sot, positive_int, read_text_file, save_suffix_store, sampling_kwargs, stdin_or,
    stop_string, top_logprobs,
)
from sot.errors import SoTError

if TYPE_CHECKING:
    from sot.api import Completion, SoT
    from sot.tools import ToolUse


def add_generate_parsers(sub: argparse._SubParsersAction) -> None:
    """``generate``, ``trace`` and ``chat``."""
    gen = sub.add_parser("generate", help="generate text for a prompt or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", help="the prompt text ('-': read it from standard input)")
    gen.add_argument("--prompts",
                     help="JSONL file ('-': standard input): {'prompt'}, {'messages'} or {'turns'} per line")
    add_drafter_args(gen)
    gen.add_argument("--batch-size", type=positive_int, default=1,
                     help="sequences decoded together; a finished one's place goes to the next prompt")
    gen.add_argument("--stop", action="append", default=[], type=stop_string, help="stop string (repeatable)")
    gen.add_argument("--prediction", metavar="FILE", default=None,
                     help="a file whose text the answer is expected to repeat in large part (the file a prompt asks "
                          "to edit): drafted from, so the answer comes faster, and is the same with it or without")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--logprobs", type=top_logprobs, default=None, metavar="K",
                     help="with --json: each token's log probability under the model, with the K most likely "
                          "tokens at its position (0-20)")
    gen.add_argument("--trace", metavar="FILE.jsonl",
                     help="record every step (trees, acceptance, policy, timings, predicted states) to FILE.jsonl; "
                          "'sot trace --from FILE.jsonl' draws it")
    add_model_args(gen)
    add_adapt_args(gen)
    add_sampling_args(gen)
    add_chat_flag(gen)
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--json-schema", metavar="SCHEMA",
                      help="answer in JSON that follows this JSON schema (its text, or a file holding it)")
    form.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    form.add_argument("--regex", help="answer with text that matches this regular expression")
    form.add_argument("--choice", action="append", metavar="TEXT", help="answer with one of these texts (repeatable)")
    form.add_argument("--grammar", metavar="FILE", help="answer in the language of this Lark or GBNF grammar file")
    gen.add_argument("--tools", metavar="TOOLS",
                     help="offer these functions (OpenAI's tools list as JSON, or a file holding it); the calls "
                          "read from each answer are printed after it")
    gen.add_argument("--tool-choice", default=None, metavar="auto|none|required|NAME",
                     help="with --tools: whether the model must call a tool (required), a named one, or decides "
                          "(auto, the default)")

    tr = sub.add_parser("trace", help="draw the drafts, commits and predicted states of a generation as one HTML page")
    tr.add_argument("prompt", nargs="?", help="the prompt text")
    tr.add_argument("--prompts", help="JSONL file of prompts (as for generate)")
    tr.add_argument("--from", dest="from_file", metavar="FILE.jsonl", help="draw a trace written by generate --trace")
    tr.add_argument("--out", default="trace.html", help="the HTML page to write (default: trace.html)")
    tr.add_argument("--save", metavar="FILE.jsonl", help="also write the trace data")
    add_drafter_args(tr, store=False)
    tr.add_argument("--batch-size", type=positive_int, default=1, help="sequences decoded together")
    add_model_args(tr)
    add_sampling_args(tr)
    add_chat_flag(tr)

    sc = sub.add_parser("score", help="log probabilities and perplexity of texts under the model")
    sc.add_argument("text", nargs="?", help="the text to score ('-': read it from standard input)")
    sc.add_argument("--prompts", help="JSONL file: {'prompt'} or {'messages'} per line (messages: in the chat "
                                          "template with --chat, else their texts a line each)")
    sc.add_argument("--batch-size", type=positive_int, default=1, help="texts read together")
    sc.add_argument("--json", action="store_true", help="print one JSON object per text, with every token's figures")
    sc.add_argument("--top-logprobs", type=top_logprobs, default=0, metavar="K",
                    help="with --json: the K most likely tokens at each position (0-20)")
    add_model_args(sc, drafting=False)
    sc.add_argument("--chat", action="store_true", help="apply the chat template (default: raw text)")
    sc.set_defaults(drafter="none", predictor=None, suffix_store=None)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    add_drafter_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    add_model_args(chat)
    add_adapt_args(chat)
    add_sampling_args(chat)


def cmd_generate(args: argparse.Namespace) -> int:
    from sot.prompts import read_jsonl, with_tools

    if (args.prompt is None) == (args.prompts is None):
        raise SoTError("give either a PROMPT or --prompts FILE.jsonl")
    items = read_jsonl(args.prompts) if args.prompts else [stdin_or(args.prompt, "PROMPT")]
    if args.logprobs is not None and not args.json:
        raise SoTError("--logprobs needs --json (the figures are printed in each prompt's JSON object)")
    use = _tool_use(args)
    structured = _structured(args)
    prediction = read_text_file(args.prediction, "--prediction") if args.prediction is not None else None
    if structured is not None:
        structured.check()  # (a spec that does not compile is refused before the model loads)
    check_output_path(args.trace, "--trace")
    check_distinct_files(args)
    if use is not None:
        if args.chat is False:
            raise SoTError("--tools needs the chat template; leave out --no-chat")
        if use.format() is not None and structured is not None:
            raise SoTError(f"--tool-choice {args.tool_choice} fixes the answer's form; leave out the form flag")
        structured = use.format() or structured
        items = [with_tools(item, use.offered()) for item in items]
    sot = load_sot(args, batch=min(args.batch_size, len(items)))
    ids = [sot.encode(item, args.chat) for item in items]
    params = sot.params(stop=args.stop, logprobs=args.logprobs, structured=structured, prediction=prediction,
                        **sampling_kwargs(args))
    # one answer streams, to a terminal or a pipe alike (what a stopped run had written stays written)
    stream_one = len(ids) == 1 and not args.json and not args.trace
    if stream_one:
        for event in sot.stream(items, chat=args.chat, stop=args.stop, structured=structured, prediction=prediction,
                                **sampling_kwargs(args)):
            print(event.text, end="", flush=True)
        print()
        r = sot.last_stream[0]
        _print_calls(use, r.text)
        print(_speed_line(r.new_tokens, r.seconds, r.mean_accept_len, r.steps), file=sys.stderr)
        _adapt_line(sot)
        save_suffix_store(sot, args)
        if getattr(r, "error", None):
            print(f"sot: error: {r.error}", file=sys.stderr)
            return 1
        return 0
    done: dict[int, Completion] = {}  # finished answers not yet printed (an earlier prompt still decodes)
    printed = 0

    complete: dict[int, Completion] = {}  # every finished answer (for the trace of a stopped run)

    def finished(i: int, r: Completion) -> None:  # print answers in prompt order, each as soon as it can be
        nonlocal printed
        done[i] = complete[i] = r
        while printed in done:
            _print_answer(args, sot, use, printed, done.pop(printed), len(ids))
            printed += 1

    try:
        results = sot.generate_ids(ids, params, batch_size=args.batch_size, trace=bool(args.trace), on_done=finished)
    except KeyboardInterrupt:  # the answers that finished are not lost: those still held back go out now
        for i in sorted(done):
            _print_answer(args, sot, use, i, done[i], len(ids))
        if args.trace and complete:  # (and the trace of those answers, under their own indices)
            order = sorted(complete)
            _write_trace(args, sot, [ids[i] for i in order], [complete[i] for i in order], indices=order)
        raise
    if args.trace:  # (after the answers: a trace that cannot be written loses none of them)
        _write_trace(args, sot, ids, results)
    _adapt_line(sot)
    save_suffix_store(sot, args)
    return 1 if any(r.error for r in results) else 0


def _print_answer(args: argparse.Namespace, sot: SoT, use: ToolUse | None, i: int, r: Completion,
                  count: int) -> None:
    """One finished answer of ``sot generate``: a JSON line with ``--json``, else its text (under
    a ``--- [i]`` line when there are several), tool calls and speed line."""
    if r.error:
        print(f"sot: error: answer {i}: {r.error}", file=sys.stderr)
    if args.json:
        record = r.to_dict()
        record.pop("depth_attempts")
        record.pop("depth_accepts")
        record["index"] = i
        for entry in record.get("logprobs", []):  # (the token's text beside its id)
            _with_texts(entry, entry["token"], sot.tokenizer)
        if use is not None:
            record["tool_calls"] = [c.to_openai() for c in use.read(r.text).calls]
        print(json.dumps(record), flush=True)
    else:
        if count > 1:
            print(f"--- [{i}]")
        print(r.text, flush=True)
        _print_calls(use, r.text)
        print(_speed_line(r.new_tokens, r.seconds, r.mean_accept_len, r.steps), file=sys.stderr)


def _with_texts(entry: dict, token: int, tokenizer) -> None:
    """A ``--json`` log-probability entry with the texts of its token (``text``) and of its
    alternatives (``top_text``, in ``top``'s order)."""
    entry["text"] = tokenizer.decode([token])
    if entry.get("top"):
        entry["top_text"] = [tokenizer.decode([alt]) for alt, _ in entry["top"]]


def _tool_use(args: argparse.Namespace):
    """The tools ``--tools`` offers and ``--tool-choice``, or ``None``."""

    from sot.errors import ConfigError
    from sot.tools import ToolUse

    if args.tools is None:
        if args.tool_choice is not None:
            raise SoTError("--tool-choice needs --tools")
        return None
    text = args.tools
    if not text.lstrip().startswith(("[", "{")):  # (not JSON: a file)
        if not Path(text).is_file():
            raise SoTError(f"--tools {text}: no such file, and not a JSON list of tools")
        text = read_text_file(text, "--tools")
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SoTError(f"--tools: not a JSON list of tools or a file holding one ({exc.msg})") from None
    choice = args.tool_choice
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return ToolUse.of(tools, choice)
    except ConfigError as exc:  # (its message begins with the field: tools, tools[i] or tool_choice)
        msg = str(exc)
        flag = "--tools " if msg.startswith("tools[") else "--"
        raise SoTError(flag + msg.replace("tool_choice", "tool-choice", 1)) from None


def _print_calls(use, text: str) -> None:
    """The calls read from an answer, one line each (nothing without tools)."""
    for call in use.read(text).calls if use is not None else ():
        try:
            args = json.dumps(json.loads(call.arguments), ensure_ascii=False)
        except json.JSONDecodeError:  # (cut short by --max-new-tokens)
            args = call.arguments
        print(f"[tool call] {call.name} {args}")


def _structured(args: argparse.Namespace):
    """The form ``--json-schema``, ``--json-object``, ``--regex``, ``--choice`` or
    ``--grammar`` asks for, or ``None``."""

    from sot.structured import OutputFormat, StructuredOutput

    def text_or_file(value: str, flag: str) -> str:
        path = Path(value)
        if flag == "--json-schema" and not value.lstrip().startswith("{") and not path.is_file():
            raise SoTError(f"--json-schema {value}: no such file, and not a JSON schema (an object)")
        if flag == "--grammar" or (not value.lstrip().startswith("{") and path.is_file()):
            return read_text_file(value, flag)
        return value

    if args.json_schema is not None:
        schema = text_or_file(args.json_schema, "--json-schema")
        try:  # (what the schema asks is checked with the tokenizer, once the model is loaded)
            json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SoTError(f"--json-schema {args.json_schema}: not JSON ({exc.msg}, line {exc.lineno})") from None
        return StructuredOutput(OutputFormat.JSON_SCHEMA, schema)
    if args.json_object:
        return StructuredOutput(OutputFormat.JSON)
    if args.regex is not None:
        return StructuredOutput(OutputFormat.REGEX, args.regex)
    if args.choice:
        return StructuredOutput.choice(args.choice)
    if args.grammar is not None:
        return StructuredOutput(OutputFormat.GRAMMAR, text_or_file(args.grammar, "--grammar"))
    return None


def cmd_score(args: argparse.Namespace) -> int:
    import math

    from sot.prompts import read_jsonl

    if (args.text is None) == (args.prompts is None):
        raise SoTError("give either a TEXT or --prompts FILE.jsonl")
    if args.top_logprobs and not args.json:
        raise SoTError("--top-logprobs needs --json (the alternatives are printed in each text's JSON object)")
    text = None if args.prompts else stdin_or(args.text, "TEXT")
    if text == "" and not args.chat:
        raise SoTError("TEXT is empty: there is nothing to score")
    items = read_jsonl(args.prompts) if args.prompts else [text]
    sot = load_sot(args)
    scores = sot.score(items, chat=args.chat, top_logprobs=args.top_logprobs, batch_size=args.batch_size)
    for i, sc in enumerate(scores):
        if args.json:
            record = {"index": i, **sc.to_dict()}
            for entry, token in zip(record["logprobs"], sc.token_ids):
                if entry is not None:
                    _with_texts(entry, token, sot.tokenizer)
            print(json.dumps(record), flush=True)
        else:
            ppl = f"{sc.perplexity:.4f}" if sc.scored_tokens else "- (one token: nothing scored)"
            n = len(sc.token_ids)
            print(f"[{i}] {n} token{'s' if n != 1 else ''} ({sc.scored_tokens} scored: all but the first), "
                  f"log-likelihood {sc.total_logprob:.4f}, perplexity {ppl}")
    scored = sum(sc.scored_tokens for sc in scores)
    if len(scores) > 1 and scored:
        total = sum(sc.total_logprob for sc in scores)
        print(f"[all] {scored} scored tokens, log-likelihood {total:.4f}, perplexity {math.exp(-total / scored):.4f}",
              file=sys.stderr)
    return 0


def _adapt_line(sot) -> None:
    """With ``--adapt``: what the adapter did, on stderr."""
    if sot.adapter is None:
        return
    st = sot.adapter.stats()
    share = st["update_seconds"] / st["step_seconds"] if st["step_seconds"] else 0.0
    print(f"[adaptation: {st['updates']} updates, {st['rollbacks']} rolled back, {st['resets']} resets; "
          f"{st['update_seconds']:.2f}s, {share:.1%} of decoding time; drift {st['drift']:.4f}]", file=sys.stderr)


def _write_trace(args: argparse.Namespace, sot, ids: list[list[int]], results,
                 indices: list[int] | None = None) -> list:
    """The traces of ``results``, written to the file asked for; ``indices``: the prompts'
    places in the run, where the results are only some of its answers (a stopped run's)."""
    from sot.trace import write_trace

    traced = sot.traced(ids, results)
    if indices is not None:
        for item, i in zip(traced, indices):
            item.index = i
    path = args.trace if args.command == "generate" else args.save
    if path:
        write_trace(path, sot.trace_run(), traced)
        what = f" (the {len(traced)} finished answers)" if indices is not None else ""
        print(f"trace written to {path}{what}", file=sys.stderr)
    return traced


def cmd_trace(args: argparse.Namespace) -> int:
    from sot.trace import read_trace
    from sot.trace_page import write_page

    if sum(x is not None for x in (args.prompt, args.prompts, args.from_file)) != 1:
        raise SoTError("give one of a PROMPT, --prompts FILE.jsonl or --from TRACE.jsonl")
    check_output_path(args.out, "--out")
    check_output_path(getattr(args, "save", None), "--save")
    check_distinct_files(args)
    if args.from_file and args.save:
        raise SoTError("--save writes the data of a new generation; with --from the data is already in "
                       f"{args.from_file}")
    if args.from_file:
        from sot.cli import build_parser

        defaults = vars(build_parser().parse_args(["trace", "--from", args.from_file]))
        changed = [k for k, v in vars(args).items() if k not in ("out", "from_file") and defaults.get(k, v) != v]
        if changed:
            flags = ", ".join("--" + k.replace("_", "-") for k in changed)
            raise SoTError(f"--from draws a saved generation again, so {flags} would change nothing; drop "
                           f"{'them' if len(changed) > 1 else 'it'}, or give a PROMPT to generate anew")
        try:
            run, traced = read_trace(args.from_file)
        except OSError as exc:
            raise SoTError(f"cannot read {args.from_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise SoTError(str(exc)) from None
    else:
        from sot.prompts import read_jsonl

        items = read_jsonl(args.prompts) if args.prompts else [args.prompt]
        sot = load_sot(args, batch=min(args.batch_size, len(items)))
        ids = [sot.encode(item, args.chat) for item in items]
        params = sot.params(**sampling_kwargs(args))
        results = sot.generate_ids(ids, params, batch_size=args.batch_size, trace=True)
        traced = _write_trace(args, sot, ids, results)
        run = sot.trace_run()
    write_page(args.out, run, traced)
    print(f"wrote {args.out} ({len(traced)} sequence{'s' if len(traced) != 1 else ''})", file=sys.stderr)
    return 0


def _speed_line(tokens: int, seconds: float, tau: float, steps: int) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"[{tokens} tokens in {seconds:.2f}s, {rate:.1f} tok/s, mean accepted length {tau:.2f}, {steps} steps]"


CHAT_HELP = """commands:
  /reset   start a new conversation (the system message stays)
  /exit    end the session (also /quit or Ctrl-D; an empty line is skipped)
  /help    this list
A line that is one other /word is taken for a mistyped command, not sent (begin it with // to
send it, as /word). Ctrl-C while the model answers stops the answer; the part written stays in
the conversation."""


def chat_line(line: str) -> tuple[str, str]:
    """What a line typed in ``sot chat`` asks: ``("exit" | "help" | "reset" | "skip", "")``
    (skip: an empty line, as blank lines of piped input are), ``("unknown", "/word")`` for a
    line that is one other /word (a mistyped command, not sent), or ``("message", text)``; a
    line beginning with // is sent without its first /."""
    command = line.strip().lower()
    if not command:
        return "skip", ""
    if command in ("/exit", "/quit"):
        return "exit", ""
    if command in ("/help", "/reset"):
        return command[1:], ""
    if re.fullmatch(r"/\w+", command):
        return "unknown", line.strip()
    if line.lstrip().startswith("//"):
        return "message", line.replace("/", "", 1)
    return "message", line


def _fit_context(sot: SoT, messages: list[dict], kwargs: dict) -> bool:
    """Shorten a chat turn's ``max_new_tokens`` (and ``min_tokens``) in ``kwargs`` to the
    room the model's context leaves after the conversation, as the server does for a request
    without ``max_tokens``; returns whether it did. A conversation with no room at all is left
    for the engine to refuse."""
    limit = sot.target.max_positions
    if not limit:
        return False
    room = limit - len(sot.encode({"messages": messages}, chat=True))
    if not 1 <= room < kwargs["max_new_tokens"]:
        return False
    kwargs["max_new_tokens"] = room
    kwargs["min_tokens"] = min(kwargs["min_tokens"], room)
    return True


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat: each line is a user turn, answered as it streams. A turn that fails
    (a conversation grown past the context, say) is reported and dropped, and the session
    goes on; the earlier-answers store is written however the session ends."""
    import signal
    import time

    sot = load_sot(args)
    if not sot.is_chat_model:
        raise SoTError(f"{sot.name} has no chat template, so it cannot tell turns apart; "
                       "give one with --chat-template, or use sot generate for plain text")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    # answers go to stdout; the prompts and figures to stderr, unless both are one terminal
    label = sys.stdout if sys.stdout.isatty() else sys.stderr
    print("Chat with the model; /help lists the commands.", file=sys.stderr)
    code = 0

    def terminate(signum, frame) -> None:  # (SIGTERM) end the session as an exit does: the store is written
        raise SystemExit(128 + signum)

    previous_term = signal.signal(signal.SIGTERM, terminate)
    try:
        while True:
            try:
                if label is sys.stdout:
                    user = input("you> ")
                else:
                    print("you> ", end="", file=label, flush=True)
                    user = input()
            except EOFError:
                print(file=label)
                break
            except KeyboardInterrupt:
                print(file=label)
                code = 130
                break
            kind, user = chat_line(user)
            if kind == "exit":
                break
            if kind == "skip":
                continue
            if kind == "help":
                print(CHAT_HELP, file=sys.stderr)
                continue
            if kind == "reset":
                messages = list(system)
                print("[new conversation]", file=sys.stderr)
                continue
            if kind == "unknown":
                print(f"unknown command {user} (/help lists them; /{user} sends it as a message)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": user})
            stop = {"asked": False}

            def interrupt(signum, frame) -> None:  # stop between steps, not inside one
                stop["asked"] = True

            previous = signal.signal(signal.SIGINT, interrupt)
            reply, tokens, t0 = [], 0, time.perf_counter()
            print("bot> ", end="", file=label, flush=True)
            kwargs = sampling_kwargs(args)
            full = _fit_context(sot, messages, kwargs)
            events = None
            try:
                events = sot.stream([{"messages": list(messages)}], chat=True, **kwargs)
                for event in events:
                    print(event.text, end="", flush=True)
                    reply.append(event.text)
                    tokens += len(event.token_ids)
                    if stop["asked"]:
                        break
            except SoTError as exc:
                print(file=label)
                reason = str(exc).removeprefix("prompt 0: ")
                print(f"sot chat: {reason}" + ("; /reset starts a new conversation" if len(messages) > 2 else ""),
                      file=sys.stderr)
                messages.pop()  # the turn is dropped; the conversation stays as it was
                continue
            finally:
                if events is not None:
                    events.close()  # an answer stopped early is aborted between steps
                signal.signal(signal.SIGINT, previous)
            dt = time.perf_counter() - t0
            print()
            note = ", stopped" if stop["asked"] else ""
            if full and not stop["asked"] and tokens >= kwargs["max_new_tokens"]:
                note = ", the context is full: /reset starts a new conversation"
            print(f"[{tokens} tokens, {tokens / dt:.1f} tok/s{note}]", file=sys.stderr)
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        _adapt_line(sot)
        save_suffix_store(sot, args)
    return code
