"""Rules that change a request's logits before its token is chosen: logit bias, a minimum
length, repetition, frequency and presence penalties (as OpenAI and vLLM define them), and a
grammar's mask (structured output, :mod:`sot.structured`).

A rule depends on the text a token follows, so in a draft tree each node's row is adjusted
for its own context: the request's committed tokens and the drafted tokens on the path down
to that node. Plain decoding adjusts its one row for the same context with the same
element-wise arithmetic, so speculation stays exact: the adjusted row of a node equals, bit
for bit, the row plain decoding adjusts at that point of the text. A row is adjusted when the
acceptance walk reaches its node (:class:`AdjustedRows`), so a step pays for the nodes on the
walked path, not for the whole tree. Only the rows of requests that ask for a rule are
touched; log probabilities stay those of the raw logits.

The order follows vLLM: bias and the minimum length first, then the penalties, then
temperature, top-k and top-p (:func:`sot.sampling.processed_logits`):

- ``logit_bias``: ``x[t] += bias[t]``;
- ``min_tokens``: the end-of-sequence tokens are banned (``-inf``) while fewer than
  ``min_tokens`` tokens have been generated (and a stop string ends the answer only where it
  ends in a later token's text, :meth:`sot.requests.LiveRequest.commit`);
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


class AdjustedRows:
    """One tree's logits rows with a request's rules applied, each when it is first asked
    for: ``rows[i : i + 1]`` is node ``i``'s adjusted row (``[1, V]`` float32). It stands in
    for the logits in the acceptance functions, whose walk asks for the root and then one
    child per depth. With a grammar the request's matcher follows the walk down the tree;
    :meth:`close` returns it to the root's context (the commit then takes the accepted
    tokens).

    Args:
        logits: ``[>=N, V]`` the tree's raw logits rows, or anything that gives node ``i``'s
            row as ``logits[i]`` (a :class:`~sot.models.adapter.TreeRows`, which computes
            only the rows read).
        tree: the draft tree (``N`` nodes).
        seq: the request, with its committed answer and its rules.
    """

    def __init__(self, logits: torch.Tensor, tree: DraftTree, seq: LiveRequest) -> None:
        self.logits, self.tree, self.seq = logits, tree, seq
        self.shape = (tree.size, logits.shape[-1])
        self._rows: dict[int, torch.Tensor] = {}
        self._consumed: list[int] = []  # the nodes whose tokens the matcher has taken, in depth order
        self._counts: torch.Tensor | None = None  # [V] the answer's token counts

    def dim(self) -> int:
        return 2

    def __getitem__(self, key: slice) -> torch.Tensor:
        if not isinstance(key, slice) or key.stop is None or key.stop - (key.start or 0) != 1:
            raise TypeError("adjusted rows are read one node at a time: rows[i : i + 1]")
        node = key.start or 0
        if node not in self._rows:
            self._rows[node] = self._row(node)
        return self._rows[node][None]

    def _path(self, node: int) -> list[int]:
        """The nodes below the root down to ``node``, in depth order."""
        path = []
        while node > 0:
            path.append(node)
            node = self.tree.parents[node]
        return path[::-1]

    def _row(self, node: int) -> torch.Tensor:
        seq, sp, params = self.seq, self.seq.params.sampling, self.seq.params
        x = self.logits[node].float().clone()
        dev = x.device
        path = self._path(node)
        if sp.logit_bias:
            x[torch.tensor([t for t, _ in sp.logit_bias], device=dev)] += torch.tensor(
                [b for _, b in sp.logit_bias], dtype=torch.float32, device=dev)
        if params.min_tokens and params.eos_token_ids and \
                len(seq.result.token_ids) + len(path) < params.min_tokens:
            x[torch.tensor(params.eos_token_ids, device=dev)] = float("-inf")
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
            x = self._penalised(x, path)
        if seq.matcher is not None:
            from sot.structured import allowed_tokens

            self._follow(path)
            x.masked_fill_(~allowed_tokens(seq.matcher, x.shape[-1]).to(dev), float("-inf"))
        return x

    def _penalised(self, x: torch.Tensor, path: list[int]) -> torch.Tensor:
        """The repetition, frequency and presence penalties on one row ``x [V]``."""
        sp, vocab = self.seq.params.sampling, x.shape[-1]
        if self._counts is None:
            answer = self.seq.result.token_ids
            self._counts = (torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=vocab).float()
                            if answer else torch.zeros(vocab))
        counts = self._counts.clone()
        for n in path:
            counts[self.tree.tokens[n]] += 1
        counts = counts.to(x.device)
        if sp.repetition_penalty != 1.0:
            seen = (counts > 0) | self.seq.prompt_seen(vocab).to(x.device)
            x = torch.where(seen, torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
        if sp.frequency_penalty:
            x -= sp.frequency_penalty * counts
        if sp.presence_penalty:
            x -= sp.presence_penalty * (counts > 0).float()
        return x

    def _follow(self, path: list[int]) -> None:
        """Move the matcher to the context of ``path``'s last node."""
        common = 0
        while common < min(len(path), len(self._consumed)) and path[common] == self._consumed[common]:
            common += 1
        matcher = self.seq.matcher
        if len(self._consumed) > common:
            matcher.rollback(len(self._consumed) - common)
        del self._consumed[common:]
        for n in path[common:]:
            token = self.tree.tokens[n]
            if matcher.try_consume_tokens([token]) != 1:  # (refused: no error state, so rollback still works)
                # the walk only goes where rows allow, so this is a dead end: the grammar allows
                # no token of the vocabulary, yet its mask offered one. The answer ends before
                # this token (``LiveRequest.commit``: ``grammar``), so no row after it is used.
                break
            self._consumed.append(n)

    def close(self) -> None:
        """Return the matcher to the root's context."""
        if self._consumed:
            self.seq.matcher.rollback(len(self._consumed))
            self._consumed = []
