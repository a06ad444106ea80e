"""Test helpers of the state predictor's tests (test_predictor, test_training, test_training_data)."""
from __future__ import annotations

import socket
from pathlib import Path

import torch

from sot.drafters.state import new_predictor

LAYERS = (0, 1, 2)
ROOT = Path(__file__).resolve().parent.parent


def conversations(n: int) -> list[dict]:
    """Predictable chats (counting, repeated phrases) so a predictor can learn them fast."""
    out = []
    for i in range(n):
        words = ["red", "green", "blue", "cyan"][i % 4]
        reply = " ".join(f"{words}{j % 7}" for j in range(30 + i % 11))
        out.append({"id": f"t{i}", "conversations": [{"from": "human", "value": f"say {words} please"},
                                                      {"from": "gpt", "value": reply}]})
    return out


def two_layer_predictor(model, seed: int):
    """A two-layer predictor whose second layer is not the identity (random output weights)."""
    pred = new_predictor(model, LAYERS, None, seed=seed, decoder_layers=2)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for w in (pred.upper[0].o_proj.weight, pred.upper[0].down_proj.weight):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
    return pred


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chain_inputs(model, pred, lengths, seed):
    """Random target states and contexts for sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    vocab = model.config.vocab_size
    out = []
    for n in lengths:
        ctx = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        states = torch.randn(n, len(LAYERS), d, generator=gen)
        out.append((ctx, states))
    return out
