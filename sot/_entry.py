"""The ``sot`` command's entry point: loads the command line (which imports torch, a second
or more) inside a Ctrl-C handler, so an interrupt while it loads ends with one line, not a
traceback."""
from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sot`` (see :func:`sot.cli.main`)."""
    try:
        from sot.cli import main as run
    except KeyboardInterrupt:
        print("\nsot: interrupted", file=sys.stderr)
        return 130
    return run(argv)
