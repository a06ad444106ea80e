"""Training data for the state predictor: conversations -> token ids -> cached target states.

Data flow::

    ShareGPT (package, held-out split skipped)  or  a gen-data JSONL (self-distilled answers)
        -> rendered with the target's chat template, assistant tokens marked
        -> the target runs once per conversation (in ``--dtype``), keeping the hidden states of the
           predictor's input layers and the final (normed) hidden state
        -> shards of ``states [N, S + 1, D]`` bf16, ``tokens [N]``, ``mask [N]``, ``offsets``

A shard is one safetensors file; :class:`StateDataset` memory-maps them for training.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sot.data.sharegpt import is_heldout, load_conversations
from sot.errors import ConfigError
from sot.fingerprint import embedding_hash
from sot.prompts import json_lines

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "assistant": "assistant", "system": "system"}
SHARD_TOKENS = 200_000


def to_messages(conv: dict) -> list[dict[str, str]] | None:
    """ShareGPT turns as chat messages; ``None`` when the conversation has no assistant reply."""
    msgs = []
    for turn in conv.get("conversations") or []:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue  # (files are checked as they are read: check_conversation)
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        text = turn["value"].strip()
        if role is None or not text:
            continue
        msgs.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in msgs) or msgs[0]["role"] == "assistant":
        return None
    return msgs


def render(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], list[int]] | None:
    """Token ids of a conversation and a 0/1 mask of assistant tokens (each ``[<= max_tokens]``).

    Assistant spans are found by rendering growing prefixes of the conversation; for a chat
    template that does not render prefixes as prefixes, every token is marked.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans, prev = [], ""
        for i, m in enumerate(messages):
            cur = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not cur.startswith(prev):
                spans = [(0, len(text))]
                break
            if m["role"] == "assistant":
                spans.append((len(prev), len(cur)))
            prev = cur
    else:
        text = "\n\n".join(m["content"] for m in messages)
        spans = [(0, len(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_tokens]
    offsets = enc["offset_mapping"][:max_tokens]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]
    if len(ids) < 8 or sum(mask) == 0:
        return None
    return ids, mask


def check_conversation(record: Any, where: str) -> dict:
    """``record`` if it is a ShareGPT conversation (``{"conversations": [{"from", "value"},
    ...]}``, strings), else a :class:`ConfigError` naming ``where`` (file and line)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns):
        raise ConfigError(f"{where}: expected a conversation, {{\"conversations\": [{{\"from\": \"human\" | "
                          "\"gpt\", \"value\": text}, ...]} (as sot train gen-data writes)")
    return record


def training_conversations(source: str | Path | None = None, seed: int = 0) -> list[dict]:
    """Conversations to train on, in a fixed shuffled order. ``source`` is ``None`` for the
    packaged ShareGPT set (held-out split removed) or a JSONL file written by ``gen-data``."""
    if source is None:
        convs = [c for c in load_conversations() if not is_heldout(str(c.get("id", "")))]
    else:
        convs = [check_conversation(c, f"{source}:{n}")
                 for n, c in json_lines(source, "training data file does not exist")]
        convs = [c for c in convs if not is_heldout(str(c.get("id", "")))]
    rng = random.Random(seed)
    convs = list(convs)
    rng.shuffle(convs)
    return convs


def evaluation_conversations(source: str | Path | None, limit: int, training: list[dict] | None = None) -> list[dict]:
    """Conversations for held-out evaluation: the first ``limit`` records of the JSONL file
    ``source`` (e.g. the target's answers to prompts kept out of training), or with ``None``
    the ``sharegpt-heldout`` split (:func:`heldout_conversations`). A file that shares a
    conversation id with the ``training`` conversations is refused."""
    if source is None:
        return heldout_conversations(limit)
    convs = [check_conversation(c, f"{source}:{n}")
             for n, c in json_lines(source, "evaluation data file does not exist")][:limit]
    seen = {str(c.get("id", "")) for c in training or []} - {""}
    shared = [str(c.get("id", "")) for c in convs if str(c.get("id", "")) in seen]
    if shared:
        raise ConfigError(f"--eval-data {source} shares {len(shared)} conversation(s) with the training data "
                          f"(e.g. id {shared[0]!r}); held-out evaluation needs conversations kept out of training")
    return convs


def heldout_conversations(limit: int) -> list[dict]:
    """Held-out conversations (for evaluation only), in id-hash order."""
    convs = [c for c in load_conversations() if is_heldout(str(c.get("id", "")))]
    convs.sort(key=lambda c: hashlib.sha256(str(c.get("id", "")).encode()).hexdigest())
    return convs[:limit]


@dataclass
class _Shard:
    tokens: list[int]
    mask: list[int]
    offsets: list[int]
    states: list[torch.Tensor]


@torch.no_grad()
def target_states(model: torch.nn.Module, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """Hidden states ``[T, S + 1, D]`` of one sequence: the ``S`` chosen layers (indices into
    ``hidden_states``, 0 = embeddings) and, last, the final normed hidden state; bfloat16, on
    the host whatever the model's device."""
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    device = next(model.parameters()).device
    out = backbone(torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    picked = [hs[i][0] for i in layers] + [out.last_hidden_state[0]]
    return torch.stack(picked, dim=1).to(torch.bfloat16).cpu()


def build_state_cache(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Iterable[dict],
    out_dir: str | Path,
    layers: tuple[int, ...],
    max_tokens: int | None,
    seq_len: int = 1024,
    progress: bool = True,
) -> dict:
    """Run the target over conversations and write state shards to ``out_dir``.

    Stops after ``max_tokens`` tokens (``None``: all conversations). Writes ``meta.json`` last, so a folder with it is
    complete. Returns the metadata (token count, shard files, size in bytes).
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # (an earlier cache here is incomplete from now on)
    shard = _Shard([], [], [0], [])
    files: list[str] = []
    total = sequences = 0
    hidden = None

    def flush() -> None:
        if not shard.tokens:
            return
        name = f"shard-{len(files):04d}.safetensors"
        save_file(
            {
                "tokens": torch.tensor(shard.tokens, dtype=torch.int32),
                "mask": torch.tensor(shard.mask, dtype=torch.uint8),
                "offsets": torch.tensor(shard.offsets, dtype=torch.int64),
                "states": torch.cat(shard.states),
            },
            str(out / name),
        )
        files.append(name)
        shard.tokens, shard.mask, shard.offsets, shard.states = [], [], [0], []

    bar = tqdm(total=max_tokens, unit="tok", desc="target states", disable=not progress, dynamic_ncols=True)
    for conv in conversations:
        messages = to_messages(conv)
        if messages is None:
            continue
        rendered = render(tokenizer, messages, seq_len)
        if rendered is None:
            continue
        ids, mask = rendered
        states = target_states(model, ids, layers)
        hidden = states.shape[-1]
        shard.tokens.extend(ids)
        shard.mask.extend(mask)
        shard.offsets.append(len(shard.tokens))
        shard.states.append(states)
        total += len(ids)
        sequences += 1
        bar.update(len(ids))
        if len(shard.tokens) >= SHARD_TOKENS:
            flush()
        if max_tokens is not None and total >= max_tokens:
            break
    flush()
    bar.close()
    if not total:  # (no meta.json: the folder is not a usable cache)
        raise ConfigError(f"{out}: nothing to cache; the data holds no conversation with an assistant reply "
                          f"within {seq_len} tokens (--seq-len)")
    size = sum((out / f).stat().st_size for f in files)
    meta = {"tokens": total, "sequences": sequences, "layers": list(layers), "hidden_size": hidden,
            "seq_len": seq_len, "shards": files, "bytes": size,
            "embed_hash": embedding_hash(model.get_input_embeddings().weight)}  # (the model it was made with)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _read_meta(path: Path) -> dict:
    """A state cache's ``meta.json``, checked for the keys a dataset reads."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}); make the cache again (sot train prepare)") from None
    need = ("hidden_size", "layers", "tokens", "sequences", "bytes", "shards")
    if not isinstance(meta, dict) or any(k not in meta for k in need) or not isinstance(meta["shards"], list):
        raise ConfigError(f"{path} is not a state cache's meta.json (it lacks {', '.join(need)}); make the cache "
                          "again (sot train prepare)")
    return meta


class StateDataset:
    """Memory-mapped state shards written by :func:`build_state_cache`.

    ``folder`` is one cache folder or several (their sequences are concatenated; they must
    share hidden size and layers). ``dataset[i]`` is one sequence: ``(tokens [T] int64,
    mask [T] float, states [T, S + 1, D] bf16)``.
    """

    def __init__(self, folder: str | Path | list[str | Path]) -> None:
        folders = [Path(f) for f in (folder if isinstance(folder, (list, tuple)) else [folder])]
        if not folders:
            raise ConfigError("no state cache folder given")
        self.folder = folders[0]
        metas = []
        for f in folders:
            meta_path = f / "meta.json"
            if not f.is_dir():
                raise ConfigError(f"{f}: no such folder ('sot train prepare' makes a state cache)")
            if not meta_path.is_file():
                raise ConfigError(f"{f} holds no complete state cache (meta.json missing)")
            metas.append(_read_meta(meta_path))
        for f, m in zip(folders[1:], metas[1:]):
            first, this = metas[0].get("embed_hash"), m.get("embed_hash")  # (older caches have none)
            if first and this and first != this:
                raise ConfigError(f"state caches {folders[0]} and {f} were made with different models")
            if (m["hidden_size"], m["layers"]) != (metas[0]["hidden_size"], metas[0]["layers"]):
                raise ConfigError(f"state caches {folders[0]} and {f} differ in hidden size or layers "
                                  f"({metas[0]['hidden_size']}, {metas[0]['layers']} vs {m['hidden_size']}, {m['layers']})")
        self.meta = dict(metas[0])
        for key in ("tokens", "sequences", "bytes"):
            self.meta[key] = sum(m[key] for m in metas)
        self.meta["shards"] = [str(f / name) for f, m in zip(folders, metas) for name in m["shards"]]
        self._files = []
        self._index: list[tuple[int, int, int]] = []
        for s, name in enumerate(self.meta["shards"]):
            try:
                fh = safe_open(name, framework="pt")
                offsets = fh.get_tensor("offsets").tolist()
            except Exception as exc:  # noqa: BLE001 (missing, truncated or foreign: each fails its own way)
                raise ConfigError(f"state cache shard {name} cannot be read ({exc}); make the cache again "
                                  "(sot train prepare)") from None
            self._files.append(fh)
            self._index.extend((s, a, b) for a, b in zip(offsets[:-1], offsets[1:]))

    def __len__(self) -> int:
        return len(self._index)

    def length(self, i: int) -> int:
        """Tokens of sequence ``i``."""
        _, a, b = self._index[i]
        return b - a

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.meta["layers"])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, a, b = self._index[i]
        fh = self._files[s]
        tokens = fh.get_slice("tokens")[a:b].to(torch.int64)
        mask = fh.get_slice("mask")[a:b].to(torch.float32)
        states = fh.get_slice("states")[a:b]
        return tokens, mask, states

    def token_counts(self, vocab_size: int, masked_only: bool = True) -> torch.Tensor:
        """``[vocab_size]`` how often each token occurs (in assistant spans when ``masked_only``)."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for fh in self._files:
            tok = fh.get_tensor("tokens").to(torch.int64)
            if masked_only:
                tok = tok[fh.get_tensor("mask").bool()]
            counts += torch.bincount(tok, minlength=vocab_size)[:vocab_size]
        return counts

    def iter_indices(self, seed: int, rank: int = 0, world: int = 1) -> Iterator[int]:
        """An endless shuffled stream of sequence indices, disjoint across ``world`` ranks."""
        epoch = 0
        while True:
            order = list(range(len(self)))
            random.Random(seed + epoch).shuffle(order)
            yield from order[rank::world]
            epoch += 1
