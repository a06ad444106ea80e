"""Acceptance: which drafted tokens of a tree become output, as pure functions.

Terms used throughout:

* **accepted** tokens are drafted tokens the target agrees with; they form a path from the
  root down the tree;
* the **bonus** token is the target's own token after the last accepted one. It is always
  produced, so every verify step commits ``accepted + 1`` tokens;
* in sampling, a rejected candidate's probability mass is removed from the **residual**
  distribution that the next candidate, or finally the bonus token, is drawn from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sot.sampling import SamplingParams, draw, gumbel_noise, processed_logits, row_argmax, target_probs
from sot.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree.

    Attributes:
        path: tree indices of the root and each accepted node, in depth order.
        tokens: the committed tokens: accepted drafted tokens then the bonus token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def _walk(tree: DraftTree, choose: "callable") -> Acceptance:
    """Follow the tree from the root while ``choose(node, children)`` returns a child index."""
    kids = tree.children()
    node, path, tokens = 0, [0], []
    while True:
        child, bonus = choose(node, kids[node])
        if child is None:
            tokens.append(bonus)
            return Acceptance(path, tokens)
        path.append(child)
        tokens.append(tree.tokens[child])
        node = child


def accept_greedy(tree: DraftTree, logits: torch.Tensor | None, argmax: list[int] | None = None) -> Acceptance:
    """Longest path whose tokens equal the target argmax, plus the argmax after it.

    Args:
        logits: ``[N, V]`` target logits at each tree node (or anything that gives node
            ``i``'s row as ``logits[i : i + 1]``: only the walked nodes' rows are read).
        argmax: the argmax of each node's logits row, when the caller took them already
            (``logits`` is then not read); ``-1`` for a node the walk does not reach
            (:func:`sot.verify.greedy_walks` leaves those rows uncomputed).
    """
    assert argmax is not None or (logits.dim() == 2 and logits.shape[0] >= tree.size)
    assert argmax is None or len(argmax) >= tree.size

    def choose(node: int, children: list[int]) -> tuple[int | None, int]:
        # (without the argmax taken already, only the walked nodes' rows are read)
        want = argmax[node] if argmax is not None else int(row_argmax(logits[node : node + 1]))
        assert want >= 0, "the walk reached a node whose argmax was not taken"
        for c in children:
            if tree.tokens[c] == want:
                return c, want
        return None, want

    return _walk(tree, choose)


def accept_rejection(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Recursive rejection sampling over the tree, with deterministic (one-hot) drafts.

    At each node the children are tried in order: candidate ``x`` is accepted with
    probability ``residual[x]``; on rejection ``x`` is removed from the residual, which is
    renormalised. When no child is accepted, the bonus token is drawn from the residual.
    The committed tokens are therefore distributed exactly as the target's samples.

    Only the nodes on the walked path need their distribution, so it is computed per node as
    the walk reaches it (a tree's other rows cost nothing here).

    Args:
        logits: ``[N, V]`` target logits at each tree node.
    """

    def choose(node: int, children: list[int]) -> tuple[int | None, int]:
        # (on the host, where the request's random stream lives, whatever the model's device)
        residual = target_probs(logits[node : node + 1].cpu(), params)[0]  # [V] float64
        for c in children:
            tok = tree.tokens[c]
            mass = residual[tok].item()
            if mass > 0 and torch.rand((), generator=generator, dtype=torch.float64).item() < mass:
                return c, tok
            residual[tok] = 0.0
            total = residual.sum()
            if total <= 0:
                break
            residual /= total
        return None, draw(residual, generator)

    return _walk(tree, choose)


def accept_coupled(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, sequence: int, root_position: int
) -> Acceptance:
    """Gumbel-max sampling with noise keyed to ``(seed, sequence, position)``.

    The target's token at a node is ``argmax(log p + g(position))``; since plain decoding
    uses the same noise at the same position, a seeded run equals plain decoding token for
    token.

    Args:
        logits: ``[N, V]`` target logits at each tree node.
        root_position: position of the root token.
    """
    assert logits.dim() == 2 and logits.shape[0] >= tree.size

    def choose(node: int, children: list[int]) -> tuple[int | None, int]:
        # one node per depth is walked: its scores and that position's noise, nothing else
        row = logits[node : node + 1].cpu()  # (the noise is drawn on the host)
        scores = torch.log_softmax(processed_logits(row, params).double(), dim=-1)[0]
        noise = gumbel_noise(params.seed, sequence, root_position + tree.depths[node] + 1, scores.shape[-1])
        want = int((scores + noise).argmax().item())
        for c in children:
            if tree.tokens[c] == want:
                return c, want
        return None, want

    return _walk(tree, choose)
