"""Multi-turn benchmark sets and the loop that runs them.

A conversation is a record ``{"id", "turns": [user message, ...]}`` (an optional ``system``
message). Each turn is answered by the method under test, the answer is appended, and the
next user message is asked, so later turns see earlier answers: what repeats across turns
(a revised file, the same JSON shapes) is there to be drafted from.

Built-in sets:

* ``sharegpt-multiturn``: held-out ShareGPT conversations with at least 3 user turns (the
  first 3 are asked);
* ``code-edit-multiturn``: each ``bench_prompts/code-edit.jsonl`` request, then two edit
  requests on the code just returned;
* ``agent-loop``: synthetic tool-calling rounds: a fixed JSON schema, a task, and each round
  a tool result with varying values and a request for the next call.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sot.errors import ConfigError, PromptTooLongError

if TYPE_CHECKING:
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerBase

    from sot.requests import GenerationParams

MULTITURN_SETS = ("sharegpt-multiturn", "code-edit-multiturn", "agent-loop")
#: user turns asked per ShareGPT conversation
SHAREGPT_TURNS = 3
CODE_EDITS = (
    "Now add type hints to every function signature. Return the complete updated code.",
    "Now add a one-line comment above each function saying what it does. Return the complete code again.",
)
_CODE_EDIT_FILE = Path(__file__).resolve().parents[2] / "bench_prompts" / "code-edit.jsonl"


def sharegpt_multiturn(limit: int | None = None) -> list[dict]:
    """Held-out conversations with at least :data:`SHAREGPT_TURNS` user turns of a usable
    length, in a fixed order."""
    import hashlib

    from sot.data.sharegpt import MAX_PROMPT_CHARS, MIN_PROMPT_CHARS, is_heldout, load_conversations

    picked = []
    for conv in load_conversations():
        cid = str(conv.get("id", ""))
        if not is_heldout(cid):
            continue
        users = [t.get("value", "").strip() for t in conv.get("conversations") or [] if t.get("from") == "human"]
        users = users[:SHAREGPT_TURNS]
        if len(users) == SHAREGPT_TURNS and all(MIN_PROMPT_CHARS <= len(u) <= MAX_PROMPT_CHARS for u in users):
            picked.append((hashlib.sha256(cid.encode()).hexdigest(), {"id": cid, "turns": users}))
    picked.sort(key=lambda x: x[0])
    out = [r for _, r in picked]
    return out[:limit] if limit else out


def code_edit_multiturn(limit: int | None = None) -> list[dict]:
    """Each code-edit request followed by the two edits of :data:`CODE_EDITS`."""
    from sot.prompts import read_jsonl

    if not _CODE_EDIT_FILE.is_file():
        raise ConfigError(f"code-edit-multiturn needs {_CODE_EDIT_FILE}, which this installation lacks")
    out = [{"id": f"{r.get('id', i)}-edits", "turns": [r["turns"][0], *CODE_EDITS]}
           for i, r in enumerate(read_jsonl(str(_CODE_EDIT_FILE)))]
    return out[:limit] if limit else out


_AGENT_SYSTEM = (
    "You are an operations agent. You act only through tools. Reply with exactly one JSON object and nothing else, "
    'of the form {"tool": NAME, "arguments": {...}, "reason": SHORT_TEXT}. Tools: '
    'get_weather {"city": string, "unit": "celsius" | "fahrenheit"}; '
    'search_flights {"origin": string, "destination": string, "date": "YYYY-MM-DD", "passengers": integer}; '
    'book_hotel {"city": string, "check_in": "YYYY-MM-DD", "nights": integer, "guests": integer}; '
    'send_email {"to": string, "subject": string, "body": string}.'
)
_CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo", "Dublin", "Warsaw")
_NAMES = ("alice", "bob", "carol", "dan", "erin", "frank", "grace", "heidi")


def agent_loop(limit: int | None = None, rounds: int = 4, seed: int = 0) -> list[dict]:
    """Synthetic tool-calling conversations (8 by default): a trip to plan, then per round a
    tool result and the next request, with the values varying by conversation."""
    rng = random.Random(seed)
    out = []
    for i in range(limit or 8):
        home, dest = rng.sample(_CITIES, 2)
        day = rng.randint(1, 28)
        date = f"2026-0{rng.randint(1, 9)}-{day:02d}"
        people = rng.randint(1, 4)
        name = rng.choice(_NAMES)
        steps = [
            f"Task: plan a trip for {name} from {home} to {dest} on {date} for {people} people. "
            f"First check the weather in {dest}.",
            f'Tool result: {{"city": "{dest}", "temperature": {rng.randint(-5, 32)}, "conditions": '
            f'"{rng.choice(["sunny", "rain", "cloudy", "snow"])}"}}. Next, search flights for the trip.',
            f'Tool result: {{"flights": [{{"id": "F{rng.randint(100, 999)}", "price": {rng.randint(60, 400)}}}, '
            f'{{"id": "F{rng.randint(100, 999)}", "price": {rng.randint(60, 400)}}}]}}. '
            f"Next, book a hotel in {dest} for {rng.randint(2, 6)} nights.",
            f'Tool result: {{"booking": "H{rng.randint(1000, 9999)}", "status": "confirmed"}}. '
            f"Finally, email {name}@example.com a summary of the plan.",
            f'Tool result: {{"sent": true}}. Now check the weather in {home} for the return.',
        ]
        out.append({"id": f"agent-{i}", "system": _AGENT_SYSTEM, "turns": steps[:rounds]})
    return out


def load_conversations(name: str, limit: int | None = None) -> list[dict]:
    """A built-in multi-turn set, or a JSONL file of ``{"turns": [...]}`` records."""
    if name == "sharegpt-multiturn":
        return sharegpt_multiturn(limit)
    if name == "code-edit-multiturn":
        return code_edit_multiturn(limit)
    if name == "agent-loop":
        return agent_loop(limit)
    from sot.bench.prompts import load_prompt_set

    records = load_prompt_set(name, limit)
    for r in records:
        if not isinstance(r, dict) or not isinstance(r.get("turns"), list) or not r["turns"]:
            raise ConfigError(f"{name}: --multiturn needs records with a 'turns' list of user messages")
    return records


def turn_messages(record: dict, answers: list[str]) -> list[dict]:
    """The chat messages of the next turn: the system message, then each earlier user turn
    with the method's own answer, then the next user turn."""
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for user, answer in zip(record["turns"], answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": record["turns"][len(answers)]})
    return messages


def render(record: dict, answers: list[str], chat: bool) -> dict:
    """The next turn's prompt record: chat messages, or with ``chat=False`` one text in which
    the turns alternate as ``User:`` and ``Assistant:`` lines."""
    messages = turn_messages(record, answers)
    if chat:
        return {"messages": messages}
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    return {"prompt": "".join(f"{names[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"}


def run_conversations(methods: list, tokenizer: PreTrainedTokenizerBase, records: list[dict],
                      params: GenerationParams, chat: bool, run_one: Callable[..., Any], bar: tqdm,
                      runs: list, notes: list[str]) -> list:
    """Every conversation, turn by turn, with the methods taking turns on each (A B C, then
    the next turn): each method answers from its own earlier answers. ``run_one(method, ids,
    params, index, id)`` runs one prompt. The run records, each with its ``turn`` (1-based)
    and a ``prompt_index`` per (conversation, turn), are appended to ``runs`` as they finish
    (so an interrupted bench keeps them) and returned. A conversation grown past the model's
    context ends before that turn for every method, with a line in ``notes``."""
    from sot.prompts import encode

    answers = {m.name: [[] for _ in records] for m in methods}
    index = 0
    for c, record in enumerate(records):
        for t in range(len(record["turns"])):
            done = len(runs)
            try:
                for m in methods:
                    ids = encode(tokenizer, render(record, answers[m.name][c], chat), chat)
                    rec = run_one(m, ids, params, index, f"{record.get('id', c)}#{t + 1}")
                    rec.turn = t + 1
                    answers[m.name][c].append(tokenizer.decode(rec.token_ids, skip_special_tokens=True))
                    runs.append(rec)
                    bar.set_postfix_str(f"{m.name} turn {t + 1} {rec.tokens_per_s:.1f} tok/s")
                    bar.update()
            except PromptTooLongError as exc:
                finished = len(runs) - done
                del runs[done:]  # the turn counts for every method or for none
                why = str(exc).removeprefix("prompt 0: ")
                notes.append(f"conversation {record.get('id', c)} ends after turn {t}: turn {t + 1}: {why}")
                bar.update(len(methods) * (len(record["turns"]) - t) - finished)  # the runs it will not make
                break
            index += 1
    return runs


def per_turn(runs: list, names: list[str]) -> dict:
    """Per turn and method: ``tokens_per_s`` (total tokens over total time), ``mean_accept_len``,
    ``prompt_share`` (time to the first token over the total: reading the prompt),
    ``cached_share`` (prompt tokens taken from the prefix cache) and ``vs_<method>`` ratios of
    tokens/s against each other method."""
    out: dict[str, dict] = {}
    for turn in sorted({r.turn for r in runs}):
        rows = {}
        for name in names:
            recs = [r for r in runs if r.turn == turn and r.method == name]
            tokens = sum(r.new_tokens for r in recs)
            seconds = sum(r.wall_time for r in recs)
            steps = sum(len(r.accept_lengths) for r in recs)
            rows[name] = {"tokens_per_s": tokens / seconds if seconds else 0.0,
                          "mean_accept_len": sum(sum(r.accept_lengths) for r in recs) / steps if steps else None,
                          "prompts": len(recs),
                          "prompt_share": sum(r.ttft for r in recs) / seconds if seconds else 0.0,
                          "cached_share": (sum(r.cached_tokens for r in recs) / sum(r.prompt_tokens for r in recs)
                                           if recs else 0.0)}
        for name, row in rows.items():
            for other, base in rows.items():
                if other != name and base["tokens_per_s"]:
                    row[f"vs_{other}"] = row["tokens_per_s"] / base["tokens_per_s"]
        out[str(turn)] = rows
    return out


def turn_table(turns: dict, names: list[str]) -> list[str]:
    """Markdown lines: tokens/s and tau per turn and method, each method against the ``state``
    method (or ``plain`` when there is no ``state``), and the prompt tokens reused and the
    share of the time spent reading prompts (of the base method's time)."""
    base = "state" if "state" in names else ("plain" if "plain" in names else None)
    others = [n for n in names if n != base] if base else []
    head = "| turn | " + " | ".join([*(f"{n} tok/s (tau)" for n in names), *(f"{n} vs {base}" for n in others),
                                     "prompt reused", "prompt reading"]) + " |"
    lines = [head, "|" + "---|" * (len(names) + len(others) + 3)]
    for turn, rows in turns.items():
        tau = lambda n: rows[n]["mean_accept_len"]  # noqa: E731 (None for a method without steps: hf)
        cells = [f"{rows[n]['tokens_per_s']:.1f} ({'-' if tau(n) is None else f'{tau(n):.2f}'})" for n in names]
        if base:
            cells += [f"{rows[n].get(f'vs_{base}', 0):.2f}x" for n in names if n != base]
        first = rows[base or names[0]]
        cells += [f"{first.get('cached_share', 0):.0%}", f"{first.get('prompt_share', 0):.0%}"]
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    return lines
