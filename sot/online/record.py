"""Recording what each verify pass computed, for on-policy training and adaptation.

A verify pass computes the target's logits and hidden states at every node of every tree.
Along the accepted path those are exactly the target's answers at the committed positions,
the states the drafter reads next, and the drafted steps show where the predictor's chains
started and how far they got. :class:`NodeRecorder` is an engine observer
(``Engine(observers=[...])``) that keeps, per sequence:

- the target's states ``[T, S, D]`` at every position it has read (the prompt's from the
  prompt pass, the answer's from the accepted nodes), plus the final normed state when the
  target returns it (layer ``num_layers``), the state regression's target;
- the target's next-token distribution at every position from the prompt's last one on, as
  its top ``k`` log-probabilities (the rest of the mass is implied);
- one chain per drafted step: the row the predictor's chain started from, the tokens accepted
  and the tree's depth. The first rejected depth is where the predictor went wrong.

Rejected branches are not kept: a node below a rejected node is never accepted, so what the
target says there cannot change the accepted length; only the committed path matters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sot.models.adapter import ForwardOutput
    from sot.requests import LiveRequest
    from sot.tree import DraftTree

#: log-probabilities kept per position (the rest of the distribution is one residual mass)
DEFAULT_TOP_K = 32


@dataclass
class OnPolicySequence:
    """One decoded sequence as the verify passes saw it (``T`` positions with target states).

    Attributes:
        tokens: ``[T]`` the token at each position (prompt, then answer; the last committed
            token, never read by the target, is not included).
        states: ``[T, S, D]`` the target states the predictor reads (bf16).
        final: ``[T, D]`` the target's final normed state at each position, or ``None``.
        top_ids: ``[T, k]`` the target's most likely next tokens at each position (int32;
            ``-1`` where unknown: prompt positions before the last).
        top_logp: ``[T, k]`` their log-probabilities (float32).
        prompt_len: ``P``; answer tokens sit at positions ``P..T-1``.
        chains: ``[C, 3]`` per drafted step: the predictor's start row (the root's position
            minus one), accepted tokens, drafted depth (int32).
        temperature: the request's sampling temperature.
    """

    tokens: torch.Tensor
    states: torch.Tensor
    final: torch.Tensor | None
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    prompt_len: int
    chains: torch.Tensor
    temperature: float = 0.0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    def crop(self, rows: int) -> "OnPolicySequence":
        """The last ``rows`` positions only (at least the answer's last rows), chains shifted;
        for cheap updates. Positions are relative, so rope sees the same offsets."""
        start = max(0, self.length - rows)
        if start == 0:
            return self
        ch = self.chains.clone()
        ch[:, 0] -= start
        ch = ch[ch[:, 0] >= 0]
        return OnPolicySequence(self.tokens[start:], self.states[start:],
                                None if self.final is None else self.final[start:], self.top_ids[start:],
                                self.top_logp[start:], max(1, self.prompt_len - start), ch, self.temperature)


def top_distribution(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [n, V]`` -> the top ``k`` ids (int32) and log-probabilities (float32), ``[n, k]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    val, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return idx.to(torch.int32), val


@dataclass
class _Open:
    prompt_len: int
    temperature: float
    tokens: list[int]
    states: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    logp: list[torch.Tensor] = field(default_factory=list)
    chains: list[tuple[int, int, int]] = field(default_factory=list)
    filled: int = 0  # positions with states so far


class NodeRecorder:
    """An engine observer that turns each finished sequence into an :class:`OnPolicySequence`.

    Args:
        state_count: ``S``, the drafter's state layers; they come first in the target's
            states. With one more layer (the target's ``num_layers``, its final normed
            state), that layer is kept as :attr:`OnPolicySequence.final`.
        top_k: log-probabilities kept per position.
        keep: keep finished sequences in :attr:`done` (set False when :attr:`on_finish`
            consumes them).
    """

    def __init__(self, state_count: int, top_k: int = DEFAULT_TOP_K, keep: bool = True) -> None:
        self.state_count = state_count
        self.top_k = top_k
        self.keep = keep
        self.done: list[OnPolicySequence] = []
        self.on_finish = None  # optional callable(OnPolicySequence)
        self.on_step = None  # optional callable(accepted per drafted chain: list[int])
        self._open: dict[int, _Open] = {}

    def _split(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.state_count
        drafter = states[..., :s, :].to(torch.bfloat16)
        final = None
        if states.shape[-2] > s:
            final = states[..., s, :].to(torch.bfloat16).cpu()
        return drafter.cpu(), final  # (kept on the host, whatever the target's device)

    # -- StepObserver
    def prefilled(self, seq: LiveRequest, states: torch.Tensor | None, logits: torch.Tensor) -> None:
        if states is None:
            return
        rec = _Open(len(seq.prompt), seq.params.sampling.temperature, list(seq.prompt))
        drafter, final = self._split(states)
        rec.states.append(drafter)
        if final is not None:
            rec.final.append(final)
        n = states.shape[0]
        ids = torch.full((n, self.top_k), -1, dtype=torch.int32)
        logp = torch.zeros(n, self.top_k)
        top_i, top_v = top_distribution(logits[None], self.top_k)
        ids[-1, : top_i.shape[1]], logp[-1, : top_v.shape[1]] = top_i[0].cpu(), top_v[0].cpu()
        rec.ids.append(ids)
        rec.logp.append(logp)
        rec.filled = n
        self._open[seq.id] = rec

    def verified(self, seqs: list[LiveRequest], trees: list[DraftTree], out: ForwardOutput,
                 paths: list[list[int]], drafted: set[int]) -> None:
        if out.states is None:
            return
        accepted = []
        for b, (seq, tree, path) in enumerate(zip(seqs, trees, paths)):
            rec = self._open.get(seq.id)
            if rec is None:
                continue
            root_pos = seq.length - 1  # before this step's tokens are committed
            if root_pos != rec.filled:  # a gap (e.g. the sequence was read before recording began)
                self._open.pop(seq.id)
                continue
            drafter, final = self._split(out.seq_states(b)[path])
            rec.states.append(drafter)
            if final is not None:
                rec.final.append(final)
            top_i, top_v = top_distribution(out.rows([out.seq_start(b) + i for i in path]), self.top_k)
            rec.ids.append(top_i.cpu())
            rec.logp.append(top_v.cpu())
            rec.tokens.extend(tree.tokens[i] for i in path)  # the root sits at root_pos
            rec.filled += len(path)
            if seq.id in drafted and tree.size > 1:
                rec.chains.append((root_pos - 1, len(path) - 1, tree.max_depth))
                accepted.append(len(path) - 1)
        if self.on_step is not None and accepted:
            self.on_step(accepted)

    def finished(self, seq: LiveRequest) -> None:
        rec = self._open.pop(seq.id, None)
        if rec is None or rec.filled <= rec.prompt_len:
            return
        # the tokens at the positions read: the prompt, then each step's root (the previous
        # step's last committed token) and accepted nodes
        tokens = torch.tensor(rec.tokens, dtype=torch.long)
        ids, logp = torch.cat(rec.ids), torch.cat(rec.logp)
        item = OnPolicySequence(
            tokens=tokens, states=torch.cat(rec.states), final=torch.cat(rec.final) if rec.final else None,
            top_ids=ids, top_logp=logp, prompt_len=rec.prompt_len,
            chains=torch.tensor(rec.chains, dtype=torch.int32).reshape(-1, 3), temperature=rec.temperature)
        if self.keep:
            self.done.append(item)
        if self.on_finish is not None:
            self.on_finish(item)

    def between_steps(self) -> None:
        pass

    def take(self) -> list[OnPolicySequence]:
        """The finished sequences so far, handed over (the recorder forgets them)."""
        out, self.done = self.done, []
        return out
