"""Rules that change a request's logits before its token is chosen: logit bias, a minimum
length, repetition, frequency and presence penalties (as OpenAI and vLLM define them), and a
grammar's mask (structured output, :mod:`sot.structured`).

A rule depends on the text a token follows, so in a draft tree each node's row is adjusted
for its own context: the request's committed tokens and the drafted tokens on the path down
to that node. Plain decoding adjusts its one row for the same context with the same
arithmetic, so speculation stays exact: the adjusted row of a node equals, bit for bit, the
row plain decoding adjusts at that point of the text. Only the rows of requests that ask for
a rule are touched; log probabilities stay those of the raw logits.

The order follows vLLM: bias and the minimum length first, then the penalties, then
temperature, top-k and top-p (:func:`sot.sampling.processed_logits`):

- ``logit_bias``: ``x[t] += bias[t]``;
- ``min_tokens``: the end-of-sequence tokens are banned (``-inf``) while fewer than
  ``min_tokens`` tokens have been generated;
- ``repetition_penalty`` ``r`` (over the prompt and the answer): a seen token's logit is
  divided by ``r`` when positive and multiplied by ``r`` otherwise;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (over the answer):
  ``x[t] -= f * count[t] + p * (count[t] > 0)``;
- a grammar: the tokens it forbids after the node's path are ``-inf``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sot.requests import GenerationParams, LiveRequest
    from sot.tree import DraftTree


def adjusts(params: GenerationParams) -> bool:
    """Whether ``params`` ask for any rule (otherwise the logits are used as they are)."""
    sp = params.sampling
    return bool(sp.logit_bias or sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or (params.min_tokens and params.eos_token_ids) or params.structured is not None)


def adjusted_rows(logits: torch.Tensor, tree: DraftTree, seq: LiveRequest) -> torch.Tensor:
    """``[N, V]`` float32: row ``i`` of ``logits [>=N, V]`` (the tree's node ``i``) with
    ``seq``'s rules applied for the context that node ends."""
    params, sp = seq.params, seq.params.sampling
    n = tree.size
    rows = logits[:n].float().clone()
    vocab = rows.shape[-1]
    answer = seq.result.token_ids
    dev = rows.device
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias], device=dev)
        rows[:, ids] += torch.tensor([b for _, b in sp.logit_bias], dtype=torch.float32, device=dev)
    if params.min_tokens and params.eos_token_ids:
        short = [i for i in range(n) if len(answer) + tree.depths[i] < params.min_tokens]
        if short:
            rows[torch.tensor(short, device=dev)[:, None],
                 torch.tensor(params.eos_token_ids, device=dev)[None, :]] = float("-inf")
    if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
        rows = _penalised(rows, tree, seq)
    if seq.matcher is not None:  # the grammar: what each node's path allows next
        from sot.structured import tree_masks

        rows.masked_fill_(~tree_masks(seq.matcher, tree, vocab).to(dev), float("-inf"))
    return rows


def _penalised(rows: torch.Tensor, tree: DraftTree, seq: LiveRequest) -> torch.Tensor:
    """The repetition, frequency and presence penalties on ``rows [N, V]``."""
    sp = seq.params.sampling
    n, vocab = rows.shape
    answer = seq.result.token_ids
    # the answer tokens each node's context holds beyond the committed ones: its path's
    path_tokens: list[list[int]] = [[]]
    for i in range(1, n):
        path_tokens.append(path_tokens[tree.parents[i]] + [tree.tokens[i]])
    counts = torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=vocab).float().repeat(n, 1) \
        if answer else torch.zeros(n, vocab)
    counts = counts.to(rows.device)
    for i, toks in enumerate(path_tokens):
        for t in toks:
            counts[i, t] += 1
    if sp.repetition_penalty != 1.0:
        seen = (counts > 0) | seq.prompt_seen(vocab).to(rows.device)[None, :]
        penalised = torch.where(rows > 0, rows / sp.repetition_penalty, rows * sp.repetition_penalty)
        rows = torch.where(seen, penalised, rows)
    if sp.frequency_penalty:
        rows -= sp.frequency_penalty * counts
    if sp.presence_penalty:
        rows -= sp.presence_penalty * (counts > 0).float()
    return rows
