"""The on-policy loss: the ``fit`` loss (unrolled on the predictor's own states) on recorded
sequences, with the target's recorded top-k distribution and row weights from where the
engine's chains started and failed.

For a recorded sequence (``T`` positions), row ``t`` reads the states of position ``t`` and the
token of ``t + 1`` and is trained towards the target's distribution at ``t + 1``. A chain the
engine drafted from row ``s`` with ``a`` tokens accepted puts unrolled step ``k`` on row
``s + k``: steps ``k < a`` are where it was right, step ``a`` is where it went wrong, and steps
after ``a`` continue from the predictor's own states past the error (with the target's
tokens). :func:`chain_weights` gives every (step, row) pair a weight: ``uniform`` on every
answer row (what ``fit`` does) plus, per recorded chain, 1 on its rows and ``error_weight``
more on its error row.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sot.drafters.state.model import StatePredictor
from sot.online.record import OnPolicySequence


@dataclass
class OnlineLossConfig:
    """Weights of the on-policy loss (defaults shared by ``sot train onpolicy`` and ``--adapt``)."""

    unroll: int = 3
    step_decay: float = 0.8
    state_weight: float = 0.2
    #: weight of every answer row, beside the recorded chains' rows (1 and 0 chains: ``fit``'s rows)
    uniform: float = 0.5
    #: extra weight of the row where a recorded chain was first rejected
    error_weight: float = 1.0
    state_noise: float = 0.05


def chain_weights(seq: OnPolicySequence, cfg: OnlineLossConfig) -> torch.Tensor:
    """``[K, T - 1]`` weights of unrolled step ``k`` at row ``t`` (0 where no chain of depth
    ``k`` reaches ``t`` or the row's target is not an answer position)."""
    k_max, rows = cfg.unroll, seq.length - 1
    answer = torch.zeros(rows)
    answer[max(0, seq.prompt_len - 1):] = 1.0  # row t targets position t + 1
    known = (seq.top_ids[1:, 0] >= 0).float()
    valid = answer * known
    w = torch.zeros(k_max, rows)
    for k in range(k_max):
        w[k, k:] = cfg.uniform * valid[k:]
    if seq.chains.shape[0]:
        start, acc = seq.chains[:, 0].long(), seq.chains[:, 1].long()
        for k in range(k_max):
            t = start + k
            ok = (t >= 0) & (t < rows)
            extra = 1.0 + cfg.error_weight * (acc[ok] == k).float()
            w[k].index_add_(0, t[ok], extra)
        w = w * valid
    return w


def _draft_index(pred: StatePredictor) -> torch.Tensor:
    """``[V]`` a target token's index in the draft vocabulary, or -1."""
    cached = pred.__dict__.get("_draft_index")
    if cached is None or cached.device != pred.draft_vocab.device:
        size = int(pred.embed.shape[0])
        cached = torch.full((size,), -1, dtype=torch.long, device=pred.draft_vocab.device)
        cached[pred.draft_vocab] = torch.arange(pred.draft_vocab.numel(), device=pred.draft_vocab.device)
        pred.__dict__["_draft_index"] = cached
    return cached


def sparse_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of draft logits ``[n, V_d]`` against a top-k target (``ids [n, k]`` draft
    indices or -1, ``logp [n, k]`` the target's log-probabilities): the target's mass on each
    listed draft token, and its remaining mass on everything else together. Returns the
    per-row cross-entropy and entropy ``[n]`` (KL = their difference)."""
    q = torch.log_softmax(logits.float(), dim=-1)
    inside = ids >= 0
    p = logp.exp() * inside
    safe = ids.clamp(min=0)
    q_top = q.gather(-1, safe)  # [n, k]
    rest_p = (1.0 - p.sum(-1)).clamp(min=0.0)
    # log of the draft mass outside the listed tokens (duplicates of -1 slots are masked out)
    listed = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, safe, inside)
    rest_q = torch.logsumexp(q.masked_fill(listed, float("-inf")), dim=-1).clamp(min=-50.0)  # finite if all listed
    ce = -(p * q_top).sum(-1) - rest_p * rest_q
    ent = -(p * torch.where(inside, logp, torch.zeros_like(logp))).sum(-1) - rest_p * rest_p.clamp(min=1e-12).log()
    return ce, ent


def online_loss(model: torch.nn.Module, pred: StatePredictor, seq: OnPolicySequence, cfg: OnlineLossConfig,
                device: torch.device, autocast: AbstractContextManager | None = None,
                weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one recorded sequence and its parts (``kl{k}``, ``acc0``, ``state0`` where the
    final states were recorded). ``model`` is what is called (a DDP wrapper or ``pred``);
    ``weights``: :func:`chain_weights` (computed when omitted)."""
    w = (chain_weights(seq, cfg) if weights is None else weights).to(device)
    rows = seq.length - 1
    inp = seq.states[:rows].unsqueeze(0).to(device).float()
    nxt = seq.tokens[1:].unsqueeze(0).to(device)
    dmap = _draft_index(pred)
    ids = seq.top_ids[1:].to(device).long()
    ids = torch.where(ids >= 0, dmap[ids.clamp(min=0)], ids)
    logp = seq.top_logp[1:].to(device)
    final = seq.final[1:].to(device).float() if seq.final is not None else None
    with autocast or nullcontext():
        outs, _ = model(inp, nxt, cfg.unroll, cfg.state_noise, 0.0)
    norm_w = sum(cfg.step_decay**k for k in range(cfg.unroll))
    total = torch.zeros((), device=device)
    parts: dict[str, float] = {}
    for k, g in enumerate(outs):
        sel = torch.nonzero(w[k] > 0).flatten()
        if sel.numel() == 0:
            continue
        wk = w[k, sel] / w[k, sel].sum()
        with autocast or nullcontext():
            gk = g[0, sel]
            logits = pred.logits(gk)
            normed = pred.out_norm(gk) if final is not None else None
        ce, ent = sparse_cross_entropy(logits, ids[sel], logp[sel])
        part = (wk * ce).sum()
        if final is not None:
            reg = F.smooth_l1_loss(normed.float(), final[sel], reduction="none").mean(-1)
            part = part + cfg.state_weight * (wk * reg).sum()
            if k == 0:
                parts["state0"] = float((wk * reg).sum().detach())
        total = total + (cfg.step_decay**k / norm_w) * part
        with torch.no_grad():
            parts[f"kl{k}"] = float((wk * (ce - ent)).sum())
            if k == 0:
                hit = (logits.float().argmax(-1) == ids[sel, 0]).float()
                parts["acc0"] = float((wk * hit).sum())
    parts["loss"] = float(total.detach())
    return total, parts
