"""The ``sot`` command line: ``generate``, ``chat``, ``trace``, ``score``, ``serve``, ``bench``,
``bench-serve``, ``train`` and ``export``, one module per group; :mod:`sot.cli.common` holds what they
share (nothing in it imports a subcommand, so there is no import circle)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from typing import Any, Sequence

from sot.cli.bench import add_bench_parser, cmd_bench
from sot.cli.common import DTYPE_CHOICES, Parser
from sot.cli.export import add_export_parser, cmd_export
from sot.cli.generate import add_generate_parsers, cmd_chat, cmd_generate, cmd_score, cmd_trace
from sot.cli.serve import add_bench_serve_parser, add_serve_parser, cmd_bench_serve, cmd_serve
from sot.cli.train import add_train_parser, cmd_train
from sot.errors import SoTError

__all__ = ["DTYPE_CHOICES", "build_parser", "main"]

HANDLERS = {"generate": cmd_generate, "chat": cmd_chat, "trace": cmd_trace, "score": cmd_score, "serve": cmd_serve,
            "bench": cmd_bench, "bench-serve": cmd_bench_serve, "train": cmd_train, "export": cmd_export}


def build_parser() -> argparse.ArgumentParser:
    """The ``sot`` parser with every subcommand."""
    from sot import __version__

    parser = Parser(prog="sot", description="SoT: lossless speculative decoding with state prediction")
    parser.add_argument("--version", action="version", version=f"sot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND",
                                title="commands")
    add_generate_parsers(sub)
    add_serve_parser(sub)
    add_bench_serve_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    add_export_parser(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser of the (sub)commands ``args`` chose (``sot train fit``'s, say)."""
    while True:
        chosen = [action.choices[getattr(args, action.dest)] for action in parser._actions
                  if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None)
                  in action.choices]
        if not chosen:
            return parser
        parser = chosen[0]


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Warnings as one line for a command's user (a library's paragraph cut to its first line;
    all of it, and the code's place, with SOT_DEBUG)."""
    debug = bool(os.environ.get("SOT_DEBUG"))
    text = str(message).strip()
    if not debug and "\n" in text:
        text = text.split("\n", 1)[0].rstrip(" :") + " (...)"
    where = f" ({filename}:{lineno})" if debug else ""
    print(f"sot: warning: {text}{where}", file=file or sys.stderr)


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's last flush of what a closed
    pipe did not take raises nothing more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # (not a file descriptor, as under a test's capture: nothing to flush)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sot`` console script."""
    warnings.showwarning = _show_warning
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else list(argv)):  # (no command: what there is to run)
        parser.print_help(sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # (named by the subcommand that refused them, whose --help lists what it takes)
        _subparser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return HANDLERS[args.command](args)
    except SoTError as exc:
        print(f"sot: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a pipeline's tools do
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # a file the user named cannot be read or written
        if os.environ.get("SOT_DEBUG"):
            raise
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"sot: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsot: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, not a traceback
        if os.environ.get("SOT_DEBUG"):
            raise
        print(f"sot: error: {type(exc).__name__}: {exc} (set SOT_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1

