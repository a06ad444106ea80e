"""What a state predictor or an acceptance model records about the target it was trained for,
so that loading it for another model fails with a clear message."""
from __future__ import annotations

import hashlib

import torch


def embedding_hash(weight: torch.Tensor) -> str:
    """A short fingerprint of an embedding matrix, independent of its storage dtype."""
    data = weight.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def tokenizer_hash(tokenizer: object) -> str | None:
    """A short fingerprint of a tokenizer's vocabulary (every token's text and id), or
    ``None`` for a tokenizer that does not list it: what a file of token ids records, so that
    it is not read with another tokenizer (models that share one may share such files)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    digest = hashlib.sha256()
    for text, i in sorted(get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{i}\t{text}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def target_fingerprint(model: torch.nn.Module) -> dict:
    """What a predictor checkpoint records about the target it was trained for."""
    from sot.models.support import text_config

    cfg = text_config(model.config)
    emb = model.get_input_embeddings().weight
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return {
        "architecture": arch,
        "hidden_size": int(emb.shape[1]),
        "vocab_size": int(emb.shape[0]),
        "num_layers": int(cfg.num_hidden_layers),
        "embed_hash": embedding_hash(emb),
    }


def predictor_fingerprint(predictor: torch.nn.Module) -> str:
    """A short fingerprint of a state predictor's own weights (its parameters, as bfloat16,
    the form predictor files keep them in), whatever dtype it runs in: what a commit policy
    trained on its drafts records, so that it is not used with another predictor."""
    digest = hashlib.sha256()
    for name, p in sorted(predictor.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
