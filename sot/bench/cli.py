"""``sot bench`` argument parsing (the harness lives in :mod:`sot.bench.runner`)."""
from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark methods side by side")
    bench.add_argument("--prompts", default="humaneval")


def cmd_bench(args: argparse.Namespace) -> int:
    raise NotImplementedError("bench")
