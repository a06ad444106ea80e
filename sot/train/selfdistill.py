"""``sot train gen-data``: regenerate ShareGPT answers with the target itself.

The first user turn of each training conversation (held-out split skipped) is answered by
the target through the SoT engine, in batches. The output is JSONL in ShareGPT layout, so
``sot train prepare --data FILE`` reads it like the packaged set. Training on the target's
own answers (self-distillation) teaches the predictor the target's style rather than the
original ShareGPT authors'.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from sot.errors import ConfigError
from sot.prompts import json_lines
from sot.train.data import to_messages, training_conversations


def _first_turns(conversations: Iterable[dict]) -> Iterator[tuple[str, str]]:
    for conv in conversations:
        messages = to_messages(conv)
        if messages is not None and messages[0]["role"] == "user":
            yield str(conv.get("id", "")), messages[0]["content"]


def read_prompts(path: str | Path) -> list[tuple[str, str]]:
    """``(id, first user turn)`` from a JSONL file whose records hold ``id`` and either
    ``prompt`` (a string, as ``sot train code-prompts`` writes) or ShareGPT ``conversations``
    (the first human turn is used)."""
    records, seen = [], set()
    for n, rec in json_lines(path, missing="--prompts file not found"):
        text = rec.get("prompt") if isinstance(rec, dict) else None
        convs = rec.get("conversations") if isinstance(rec, dict) else None
        if text is None and isinstance(convs, list):
            turns = [t for t in convs if isinstance(t, dict) and str(t.get("from", "")).lower() in ("human", "user")]
            text = turns[0].get("value") if turns else None
        ident = rec.get("id") if isinstance(rec, dict) else None
        usable_id = isinstance(ident, (str, int)) and not isinstance(ident, bool)
        if not isinstance(text, str) or not text.strip() or not usable_id:
            raise ConfigError(f"{path}:{n}: a record needs an 'id' (a string or number) and a 'prompt' (or ShareGPT "
                              "'conversations')")
        if str(ident) in seen:
            raise ConfigError(f"{path}:{n}: the id {ident!r} is used twice; each prompt needs its own")
        seen.add(str(ident))
        records.append((str(ident), text.strip()))
    if not records:
        raise ConfigError(f"{path} holds no prompts")
    return records


def generate_answers(model: str, out: str | Path, limit: int, max_new_tokens: int = 256, batch_size: int = 8,
                     temperature: float = 0.0, seed: int = 0, drafter: str = "auto",
                     max_prompt_tokens: int = 512, conversations: Iterable[dict] | None = None,
                     match: str | None = None, prompts: str | Path | None = None) -> int:
    """Append up to ``limit`` regenerated conversations to ``out``; ids already there are
    skipped, so an interrupted run resumes. Prompts longer than ``max_prompt_tokens`` are
    skipped: the training window (``prepare --seq-len``) would leave their answers little
    room, and one long prompt slows a whole batch. Returns the number of conversations in
    ``out``. ``conversations`` replaces the packaged ShareGPT training set (ShareGPT layout).
    ``match``, a regular expression, keeps only first turns it finds a match in (case
    insensitive), e.g. to add answers to coding prompts. ``prompts``, a JSONL file (see
    :func:`read_prompts`), replaces ShareGPT as the source of first turns."""
    from tqdm import tqdm

    from sot.api import SoT

    if batch_size < 1 or limit < 1:
        raise ConfigError("limit and batch size must be >= 1")
    try:
        pattern = re.compile(match, re.IGNORECASE) if match else None
    except re.error as exc:
        raise ConfigError(f"--match {match!r} is not a valid regular expression: {exc}") from None
    path = Path(out)
    done: set[str] = set()
    if path.is_file():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                if number < len(lines):
                    raise ConfigError(f"{path}:{number}: not a record this command wrote; fix or remove "
                                      "that line to resume") from None
                # the last line, cut short by an interrupted run: dropped, and its answer made again
                path.write_text("".join(x + "\n" for x in lines[:-1]))
    source: Iterable[tuple[str, str]]
    if prompts is not None:
        source = read_prompts(prompts)
    sot = SoT.load(model, drafter=drafter)
    context = sot.target.max_positions
    if context and max_new_tokens >= context:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in this model's context "
                          f"of {context} tokens")
    if prompts is None:
        source = _first_turns(training_conversations() if conversations is None else conversations)
    todo = []
    for cid, text in source:
        if len(todo) + len(done) >= limit:
            break
        if cid in done:
            continue
        if pattern is not None and not pattern.search(text):
            continue
        if len(sot.tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            continue
        rendered = sot.encode({"messages": [{"role": "user", "content": text}]}, chat=True)
        if context and len(rendered) + max_new_tokens > context:  # (a cut prompt would not match its record)
            continue
        todo.append((cid, text))
    if not todo and not done:
        what = f"no first turn matches --match {match!r}" if pattern is not None else "no prompt fits"
        raise ConfigError(f"{what} (with --max-prompt-tokens {max_prompt_tokens} and --max-new-tokens "
                          f"{max_new_tokens} in this model's context): nothing to answer")
    if len(todo) + len(done) < limit:
        print(f"gen-data: the source ran out at {len(todo) + len(done)} of --limit {limit} conversations",
              file=sys.stderr)
    params = sot.params(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh, tqdm(total=len(todo), desc="gen-data", unit="conv") as bar:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            ids = [sot.encode({"messages": [{"role": "user", "content": text}]}, chat=True) for _, text in chunk]
            for (cid, text), res in zip(chunk, sot.generate_ids(ids, params, batch_size=len(ids))):
                record = {"id": cid, "conversations": [{"from": "human", "value": text},
                                                       {"from": "gpt", "value": res.text}]}
                fh.write(json.dumps(record) + "\n")
            fh.flush()
            bar.update(len(chunk))
    return len(done) + len(todo)
