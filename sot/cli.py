"""The ``sot`` command line: ``generate``, ``chat``, ``serve``, ``bench``, ``bench-serve``, ``train``."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from sot.drafters.base import DRAFT_TOP_K, TreeBudget
from sot.errors import SoTError
from sot.policy.config import PolicyConfig, PolicyKind
from sot.requests import GenerationParams
from sot.sampling import SamplingMode, SamplingParams


def _checked(cast: type, name: str, ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: parse with ``cast`` and require ``ok(value)``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


_positive_int = _checked(int, "an integer", lambda v: v >= 1, ">= 1")
_non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")
_non_negative_float = _checked(float, "a number", lambda v: v >= 0, ">= 0")
_probability = _checked(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")


#: values of --dtype (sot.models.loading.resolve_dtype interprets them; kept here so that
#: parsing arguments does not import torch; a test checks that the two lists agree)
DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a model folder or a .gguf file")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="engine dtype (default auto: bfloat16 on hardware with native bf16 such as AMX, else float32)")
    add_tree_args(p)
    p.add_argument("--predictor", default=None, help="state predictor file (default: the one shipped for the default model)")
    add_policy_args(p)


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """The draft tree's size, depth and width; defaults from :class:`~sot.drafters.TreeBudget`
    and :data:`~sot.drafters.DRAFT_TOP_K`."""
    p.add_argument("--max-nodes", "--budget", dest="max_nodes", type=_positive_int, default=TreeBudget.max_nodes,
                   help=f"draft tree size per step (nodes verified at most), root included (default {TreeBudget.max_nodes})")
    p.add_argument("--max-depth", type=_non_negative_int, default=TreeBudget.max_depth,
                   help=f"how far a draft tree may look ahead (default {TreeBudget.max_depth})")
    p.add_argument("--draft-top-k", dest="draft_top_k", type=_positive_int, default=DRAFT_TOP_K,
                   help=f"children per expanded node of a state-predictor tree; the width of --policy static trees "
                        f"(default {DRAFT_TOP_K})")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """The commit policy's flags; defaults from :class:`~sot.policy.PolicyConfig`."""
    p.add_argument("--policy", choices=[k.value for k in PolicyKind], default=PolicyConfig.kind.value,
                   help="commit policy: heuristic (default: cost model + fallback), learned (a trained acceptance "
                        "model + cost model + fallback), auto (learned when an acceptance model fits the model, "
                        "else heuristic) or static (a fixed tree of top-k nodes per depth)")
    p.add_argument("--policy-model", default=None,
                   help="acceptance model of --policy learned (default: the one shipped for the default model)")
    p.add_argument("--warmup", type=_non_negative_int, default=PolicyConfig.warmup,
                   help="tokens decoded plainly at the start of a sequence")
    p.add_argument("--fallback-threshold", type=_non_negative_float, default=PolicyConfig.fallback_threshold,
                   help="fall back to plain decoding when recent speed / plain speed drops below this")
    p.add_argument("--disable-above", type=_non_negative_int, default=PolicyConfig.disable_above,
                   help="a fixed rule instead of batch planning: no speculation while more than N sequences "
                        "run (0: off, the default)")


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    return PolicyConfig(kind=PolicyKind(args.policy), warmup=args.warmup, fallback_threshold=args.fallback_threshold,
                        model_path=args.policy_model, disable_above=args.disable_above)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=GenerationParams.max_new_tokens)
    p.add_argument("--temperature", type=_non_negative_float, default=SamplingParams.temperature,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=_probability, default=SamplingParams.top_p)
    p.add_argument("--top-k", type=_non_negative_int, default=SamplingParams.top_k, help="sampling top-k (0: off)")
    p.add_argument("--seed", type=int, default=SamplingParams.seed)
    p.add_argument("--sampling", choices=[m.value for m in SamplingMode], default=SamplingParams.mode.value,
                   help="rejection: exact in distribution; coupled: seeded output equals plain decoding's")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def add_chat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default: on for chat models)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="feed prompts as raw text")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sot", description="SoT: lossless speculative decoding with state prediction")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for a prompt or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompts", help="JSONL file: {'prompt'}, {'messages'} or {'turns'} per line")
    gen.add_argument("--drafter", choices=["auto", "none", "pld", "state"], default="auto",
                     help="auto: the state predictor when one fits the model, else pld")
    gen.add_argument("--batch-size", type=_positive_int, default=1,
                     help="sequences decoded together; a finished one's place goes to the next prompt")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--trace", metavar="FILE.jsonl",
                     help="record every step (trees, acceptance, policy, timings, predicted states) to FILE.jsonl; "
                          "'sot trace --from FILE.jsonl' draws it")
    add_model_args(gen)
    add_sampling_args(gen)
    add_chat_flag(gen)

    tr = sub.add_parser("trace", help="draw the drafts, commits and predicted states of a generation as one HTML page")
    tr.add_argument("prompt", nargs="?", help="the prompt text")
    tr.add_argument("--prompts", help="JSONL file of prompts (as for generate)")
    tr.add_argument("--from", dest="from_file", metavar="FILE.jsonl", help="draw a trace written by generate --trace")
    tr.add_argument("--out", default="trace.html", help="the HTML page to write (default: trace.html)")
    tr.add_argument("--save", metavar="FILE.jsonl", help="also write the trace data")
    tr.add_argument("--drafter", choices=["auto", "none", "pld", "state"], default="auto",
                    help="auto: the state predictor when one fits the model, else pld")
    tr.add_argument("--batch-size", type=_positive_int, default=1, help="sequences decoded together")
    add_model_args(tr)
    add_sampling_args(tr)
    add_chat_flag(tr)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    chat.add_argument("--drafter", choices=["auto", "none", "pld", "state"], default="auto",
                      help="auto: the state predictor when one fits the model, else pld")
    chat.add_argument("--system", default=None, help="system message")
    add_model_args(chat)
    add_sampling_args(chat)

    from sot.bench.cli import add_bench_parser
    from sot.server.cli import add_serve_parser

    add_serve_parser(sub, add_model_args, _positive_int, _non_negative_float)
    from sot.server.bench import add_bench_serve_parser

    add_bench_serve_parser(sub, _positive_int)
    add_bench_parser(sub)
    from sot.train.cli import add_train_parser

    add_train_parser(sub, _positive_int, _checked(float, "a number", lambda v: v > 0, "> 0"))
    return parser


def _load(args: argparse.Namespace):
    from sot.api import SoT
    from sot.models.loading import dtype_name, resolve_dtype

    print(f"loading {args.model} ({dtype_name(resolve_dtype(args.dtype))}, drafter {args.drafter}) ...", file=sys.stderr)
    return SoT.load(args.model, drafter=args.drafter, dtype=args.dtype, max_nodes=args.max_nodes,
                    max_depth=args.max_depth, predictor=args.predictor, top_k=args.draft_top_k,
                    policy=policy_from_args(args))


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        sampling=args.sampling,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from sot.prompts import read_jsonl

    if (args.prompt is None) == (args.prompts is None):
        raise SoTError("give either a PROMPT or --prompts FILE.jsonl")
    items = read_jsonl(args.prompts) if args.prompts else [args.prompt]
    sot = _load(args)
    ids = [sot.encode(item, args.chat) for item in items]
    params = sot.params(stop=args.stop, **_sampling_kwargs(args))
    stream_one = len(ids) == 1 and not args.json and sys.stdout.isatty() and not args.trace
    if stream_one:
        for event in sot.stream(items, chat=args.chat, stop=args.stop, **_sampling_kwargs(args)):
            print(event.text, end="", flush=True)
        print()
        r = sot.last_stream[0]
        print(_speed_line(r.new_tokens, r.seconds, r.mean_accept_len, r.steps), file=sys.stderr)
        return 0
    results = sot.generate_ids(ids, params, batch_size=args.batch_size, trace=bool(args.trace))
    if args.trace:
        _write_trace(args, sot, ids, results)
    for i, r in enumerate(results):
        if args.json:
            record = r.to_dict()
            record.pop("depth_attempts")
            record.pop("depth_accepts")
            record["index"] = i
            print(json.dumps(record), flush=True)
        else:
            if len(results) > 1:
                print(f"--- [{i}]")
            print(r.text)
            print(_speed_line(r.new_tokens, r.seconds, r.mean_accept_len, r.steps), file=sys.stderr)
    return 0


def _write_trace(args: argparse.Namespace, sot, ids: list[list[int]], results) -> list:
    from sot import __version__
    from sot.models.loading import dtype_name
    from sot.trace import write_trace

    traced = sot.traced(ids, results)
    path = args.trace if args.command == "generate" else args.save
    if path:
        run = {"model": sot.name, "drafter": sot.engine.drafter.kind.value, "dtype": dtype_name(sot.target.dtype),
               "version": __version__}
        write_trace(path, run, traced)
        print(f"trace written to {path}", file=sys.stderr)
    return traced


def cmd_trace(args: argparse.Namespace) -> int:
    from sot.trace import read_trace
    from sot.trace_page import write_page

    if sum(x is not None for x in (args.prompt, args.prompts, args.from_file)) != 1:
        raise SoTError("give one of a PROMPT, --prompts FILE.jsonl or --from TRACE.jsonl")
    if args.from_file:
        try:
            run, traced = read_trace(args.from_file)
        except OSError as exc:
            raise SoTError(f"cannot read {args.from_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise SoTError(str(exc)) from None
    else:
        from sot import __version__
        from sot.models.loading import dtype_name
        from sot.prompts import read_jsonl

        items = read_jsonl(args.prompts) if args.prompts else [args.prompt]
        sot = _load(args)
        ids = [sot.encode(item, args.chat) for item in items]
        params = sot.params(**_sampling_kwargs(args))
        results = sot.generate_ids(ids, params, batch_size=args.batch_size, trace=True)
        traced = _write_trace(args, sot, ids, results)
        run = {"model": sot.name, "drafter": sot.engine.drafter.kind.value, "dtype": dtype_name(sot.target.dtype),
               "version": __version__}
    write_page(args.out, run, traced)
    print(f"wrote {args.out} ({len(traced)} sequence{'s' if len(traced) != 1 else ''})", file=sys.stderr)
    return 0


def _speed_line(tokens: int, seconds: float, tau: float, steps: int) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"[{tokens} tokens in {seconds:.2f}s, {rate:.1f} tok/s, mean accepted length {tau:.2f}, {steps} steps]"


def cmd_chat(args: argparse.Namespace) -> int:
    sot = _load(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not user.strip():
            return 0
        messages.append({"role": "user", "content": user})
        reply = []
        import time

        t0 = time.perf_counter()
        tokens = 0
        print("bot> ", end="", flush=True)
        for event in sot.stream([{"messages": list(messages)}], chat=sot.is_chat_model, **_sampling_kwargs(args)):
            print(event.text, end="", flush=True)
            reply.append(event.text)
            tokens += len(event.token_ids)
        dt = time.perf_counter() - t0
        print()
        print(f"[{tokens} tokens, {tokens / dt:.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sot`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate, "chat": cmd_chat, "trace": cmd_trace}
    try:
        if args.command == "bench":
            from sot.bench.cli import cmd_bench

            return cmd_bench(args)
        if args.command == "serve":
            from sot.server.cli import cmd_serve

            return cmd_serve(args, _load)
        if args.command == "bench-serve":
            from sot.server.bench import cmd_bench_serve

            return cmd_bench_serve(args)
        if args.command == "train":
            from sot.train.cli import cmd_train

            return cmd_train(args)
        return handlers[args.command](args)
    except SoTError as exc:
        print(f"sot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsot: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, not a traceback
        if os.environ.get("SOT_DEBUG"):
            raise
        print(f"sot: error: {type(exc).__name__}: {exc} (set SOT_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
