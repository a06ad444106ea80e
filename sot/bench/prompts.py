"""Prompt sets for ``sot bench``: a JSONL file or a built-in set."""
from __future__ import annotations

import random
from pathlib import Path

from sot.errors import ConfigError
from sot.prompts import read_jsonl

LONG_PROMPTS = [
    "Write a detailed, multi-chapter short story (at least 1,500 words) about a lighthouse keeper who discovers a message in a bottle.",
    "Explain, in a long and thorough essay of at least 1,200 words, how the internet works, from physical cables to web browsers.",
    "Write a complete beginner's tutorial, with many code examples, on Python classes, inheritance and decorators. Make it at least 1,500 words.",
    "Describe the history of the Roman Empire from its founding to its fall, in a long essay of at least 1,500 words with sections.",
    "Write a comprehensive travel guide to Japan covering cities, food, etiquette, transport and seasons. At least 1,200 words.",
    "Write a long technical design document for a to-do list web application: requirements, architecture, data model, API, testing and deployment.",
    "Explain photosynthesis and cellular respiration in depth for a high-school student, with examples and a summary table. At least 1,200 words.",
    "Write a long dialogue between two philosophers debating free will, at least 1,500 words.",
    "Write a detailed guide to training for a first marathon: a 16-week plan, nutrition, injuries and race day. At least 1,500 words.",
    "Write the full text of a long README for an imaginary open-source database project, with installation, configuration, examples and FAQ.",
]

_WORDS = (
    "apple river stone cloud lamp violet engine paper marble tiger window salt orbit candle "
    "forest mirror rocket velvet harbor puzzle copper meadow signal lantern falcon quartz"
).split()


def adversarial_prompts(n: int = 20, seed: int = 0) -> list[dict]:
    """Prompts whose answers are hard to predict: random strings and shuffled words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            sample = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(24))
            text = f"Write a long string of random letters and digits, with no pattern at all, like {sample}. Continue for 500 characters."
        else:
            words = rng.sample(_WORDS, len(_WORDS))
            text = "Shuffle these words into a new random order and keep producing more random orders: " + " ".join(words)
        out.append({"id": f"adversarial-{i}", "turns": [text]})
    return out


BUILTIN = ("sharegpt-heldout", "humaneval", "code-edit", "long", "long-context", "adversarial", "mix")


def load_prompt_set(name: str, limit: int | None = None, chat: bool = True) -> list[dict]:
    """Records (``prompt`` / ``messages`` / ``turns``) of a built-in set or a JSONL file."""
    if name == "sharegpt-heldout":
        from sot.data.sharegpt import heldout_prompts

        records = heldout_prompts(limit)
    elif name == "humaneval":
        from sot.data.humaneval import humaneval_prompts

        records = humaneval_prompts(chat=chat, limit=limit)
    elif name == "code-edit":  # refactor HumanEval's reference solutions
        from sot.data.humaneval import code_edit_prompts

        records = code_edit_prompts(limit)
    elif name == "long-context":  # long prompts: attention over them bounds each step
        from sot.data.humaneval import long_context_prompts

        records = long_context_prompts(limit)
    elif name == "long":
        records = [{"id": f"long-{i}", "turns": [t]} for i, t in enumerate(LONG_PROMPTS)]
    elif name == "adversarial":
        records = adversarial_prompts()
    elif name == "mix":  # predictable and unpredictable prompts, alternating (for batches)
        from sot.data.sharegpt import heldout_prompts

        adv = adversarial_prompts()
        records = [r for pair in zip(heldout_prompts(len(adv)), adv) for r in pair]
    elif Path(name).suffix == ".jsonl" or Path(name).exists():
        records = read_jsonl(name)
    else:
        raise ConfigError(f"unknown prompt set {name!r}: use a .jsonl file or one of {', '.join(BUILTIN)}")
    return records[:limit] if limit else records
