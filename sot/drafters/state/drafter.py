"""The runtime drafter: grows trees from a :class:`StatePredictor` (see :mod:`sot.drafters.state`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sot.drafters.base import DRAFT_TOP_K, DraftInput, Drafter, DrafterKind, TreeBudget
from sot.drafters.free import FreeDrafts
from sot.drafters.state.model import StatePredictor
from sot.drafters.suffix import SuffixStores
from sot.errors import ConfigError
from sot.sampling import noise_capacity, processed_logits, top_log_softmax
from sot.tree import DraftTree


class _SeqState:
    """One sequence's predictor KV cache and last predicted state.

    Rows ``[0, length)`` are real (built from target states); rows after them are scratch
    space for the draft tree being grown and are overwritten by the next tree.
    """

    def __init__(self, layers: int = 1) -> None:
        self.layers = layers
        self.k: list[torch.Tensor] = []  # per decoder layer [Hkv, cap, hd]
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.last: torch.Tensor | None = None  # [D] prediction for the root's position

    def reserve(self, n: int, like: torch.Tensor | None = None) -> None:
        """Make room for ``n`` rows after ``length`` in every layer's cache (``like``: a
        ``[Hkv, *, hd]`` tensor, needed before the first rows)."""
        if self.k and self.length + n <= self.k[0].shape[1]:
            return
        like = like if like is not None else self.k[0]
        cap = max(256, 2 * (self.length + n))
        for store in (self.k, self.v):
            for i in range(self.layers):
                grown = like.new_zeros(like.shape[0], cap, like.shape[2])
                if i < len(store):
                    grown[:, : self.length] = store[i][:, : self.length]
                    store[i] = grown
                else:
                    store.append(grown)

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store decoder layer ``layer``'s rows ``k, v [Hkv, n, hd]`` at ``length + at``
        (reserved beforehand)."""
        n = k.shape[1]
        self.k[layer][:, self.length + at : self.length + at + n] = k
        self.v[layer][:, self.length + at : self.length + at + n] = v

    def attend(self, layer: int, q: torch.Tensor, extra: int, mask: torch.Tensor,
               first: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder layer ``layer``'s ``q [H, m, hd]`` over the real rows plus the first
        ``extra`` scratch rows, which are visible per ``mask [m, extra]``. Real rows are all
        visible, or (a sliding window) from ``first [m]`` on per query. Returns ``[H, m, hd]``."""
        n = self.length + extra
        full = torch.ones(q.shape[1], n, dtype=torch.bool, device=q.device)
        full[:, self.length :] = mask
        if first is not None:
            full[:, : self.length] = torch.arange(self.length, device=q.device) >= first[:, None]
        return F.scaled_dot_product_attention(q.unsqueeze(0), self.k[layer][None, :, :n], self.v[layer][None, :, :n],
                                              attn_mask=full, enable_gqa=True).squeeze(0)


class _Growth:
    """A tree being grown for one sequence: candidate nodes and the draft rows behind them."""

    def __init__(self, seq: _SeqState, root: int, root_pos: int, source: DraftInput) -> None:
        self.seq, self.root, self.root_pos = seq, root, root_pos
        self.source = source  # what the engine gave (its context and rules)
        # candidate nodes: token, parent (-1 = root), depth, cumulative log-prob
        self.tok: list[int] = []
        self.par: list[int] = []
        self.dep: list[int] = []
        self.score: list[float] = []
        self.frontier: list[int] = []
        self.row_of: dict[int, int] = {}  # expanded node -> its scratch row
        self.anc_rows: list[list[int]] = []  # scratch row -> scratch rows it may see
        self.state: dict[int, torch.Tensor] = {}  # expanded node -> predicted state [D]

    def add(self, parent: int, depth: int, base: float, logp: list[float], ids: list[int], vocab: list[int]) -> list[int]:
        new = []
        for s, i in zip(logp, ids):
            self.tok.append(vocab[i]), self.par.append(parent), self.dep.append(depth), self.score.append(base + s)
            new.append(len(self.tok) - 1)
        return new


class StateDrafter(Drafter):
    """Proposes trees from a :class:`StatePredictor` rolled forward on its own states.

    All sequences of a batch are drafted together: at every depth one predictor pass runs
    over the frontier nodes of every tree (attention alone is per sequence, over its own
    cache).

    Args:
        predictor: the loaded predictor.
        top_k: children considered per expanded node, and nodes expanded per depth.
        lookup: merge the best prompt-lookup continuation into each tree, and offer it alone
            (:meth:`propose_free`) on the steps the policy keeps the predictor idle.
        lookup_confidence: the confidence of the ``d``-th lookup token is this to the ``d``;
            ``None`` (default) uses the sequence's measured lookup match rate
            (:class:`~sot.drafters.pld.LookupRate`).
        min_confidence: nodes below this cumulative draft probability are not expanded.
        suffix: global suffix stores: merge each sequence's suffix tree (its own context and
            earlier answers, :mod:`sot.drafters.suffix`) into its trees too, and offer it free.
    """

    kind = DrafterKind.STATE

    def __init__(self, predictor: StatePredictor, top_k: int = DRAFT_TOP_K, lookup: bool = True,
                 lookup_confidence: float | None = None, min_confidence: float = 0.05,
                 suffix: SuffixStores | None = None) -> None:
        if top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {top_k}")
        self.free = FreeDrafts(lookup, lookup_confidence, suffix) if lookup or suffix is not None else None
        self.min_confidence = min_confidence
        self.predictor = predictor.eval()
        self.predictor.pack_for_inference()
        self.state_layers = tuple(predictor.config.state_layers)
        self.layers = predictor.config.decoder_layers
        self.top_k = top_k
        self.seqs: dict[int, _SeqState] = {}  # by DraftInput.sequence
        #: follow each request's penalties and bias in its drafts (:class:`DraftRules`)
        self.follow_rules = True
        #: draft a coupled-sampled sequence by its draw's noise (:meth:`_child_logp`)
        self.follow_draws = True
        self.dtype = next(predictor.parameters()).dtype
        #: where the predictor runs (the target's device: the states come from there)
        self.device = next(predictor.parameters()).device
        self._vocab = predictor.draft_vocab.tolist()
        self._vocab_ids = predictor.draft_vocab.to(torch.long).cpu()  # [Vd] target ids (noise is drawn on the host)
        self._index = {t: i for i, t in enumerate(self._vocab)}  # token -> draft-vocabulary row

    @property
    def static_width(self) -> int:  # the static policy's beam: top_k nodes per depth
        return self.top_k

    @property
    def suffix_stores(self) -> SuffixStores | None:
        return self.free.suffix if self.free is not None else None

    def reset(self, batch_size: int = 0) -> None:
        self.seqs.clear()
        if self.free is not None:
            self.free.reset()

    def release(self, sequence: int) -> None:
        self.seqs.pop(sequence, None)
        if self.free is not None:
            self.free.release(sequence)

    def remember(self, prompt: list[int], answer: list[int], tenant: str | None = None) -> None:
        if self.free is not None:
            self.free.remember(prompt, answer, tenant)

    def _seq(self, sequence: int) -> _SeqState:
        if sequence not in self.seqs:
            self.seqs[sequence] = _SeqState(self.layers)
        return self.seqs[sequence]

    def prepare(self, inputs: list[DraftInput]) -> None:
        """Absorb the given states (a new sequence's prompt) into the predictor caches."""
        self._absorb_inputs(inputs)

    def propose_free(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree] | None:
        """Each sequence's free drafts as one tree (:meth:`FreeDrafts.free_tree`): its best
        prompt-lookup chain and suffix tree; root-only trees where nothing matches. ``None``
        without free drafts."""
        if self.free is None:
            return None
        return [self.free.free_tree(x, budget) for x in inputs]

    @torch.no_grad()
    def _absorb(self, items: list[tuple[_SeqState, torch.Tensor, list[int], int]]) -> None:
        """Add real rows to the sequences' predictor caches in one pass. Each item is
        ``(seq, states [n, S, D], next_tokens [n], first_pos)``."""
        p = self.predictor
        self.passes += 1
        x = p.fuse_states(torch.cat([it[1] for it in items]).to(self.device, self.dtype)).unsqueeze(0)
        tokens = torch.tensor([[t for it in items for t in it[2]]], device=self.device)
        pos = torch.tensor([[it[3] + i for it in items for i in range(it[1].shape[0])]], device=self.device)
        h, q, k, v = p.project(x, tokens, pos)
        window = p.config.window
        parts = []
        for seq, states, _, _ in items:
            n = states.shape[0]
            seq.reserve(n, k[0])
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            if window:  # a row sees the rows after its position - window, new ones included
                causal &= torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1 - window)
            parts.append((seq, 0, causal))
        h = self._layers(h, q, k, v, pos, parts)
        g, at = h[0], 0
        for seq, states, _, _ in items:
            seq.length += states.shape[0]
            at += states.shape[0]
            seq.last = g[at - 1]

    def _layers(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                parts: list[tuple[_SeqState, int, torch.Tensor]]) -> torch.Tensor:
        """Every decoder layer over one pass's rows ``h [1, M, D]`` (``q, k, v``: the first
        layer's, at ``pos [1, M]``). The rows are the sequences' ``parts`` in order, each
        ``(seq, base, mask [m, base + m])``: its ``m`` rows are written to its cache from
        scratch row ``base`` on and see its real rows (within the window) plus the scratch
        rows ``mask`` allows. Returns the stream after the last layer ``[1, M, D]``."""
        p = self.predictor
        window = p.config.window
        for i in range(self.layers):
            if i > 0:
                q, k, v = p.layer_qkv(i, h, pos)
            outs, at = [], 0
            for seq, base, mask in parts:
                m = mask.shape[0]
                seq.write(i, base, k[0, :, at : at + m], v[0, :, at : at + m])
                first = pos[0, at : at + m] - window + 1 if window else None
                outs.append(seq.attend(i, q[0, :, at : at + m], base + m, mask, first))
                at += m
            h = p.finish(h, torch.cat(outs, dim=1).unsqueeze(0), i)
        return h

    def _absorb_inputs(self, inputs: list[DraftInput]) -> None:
        """Absorb the states the inputs carry, all sequences in one pass."""
        fresh = []
        for x in inputs:
            if x.states is not None and x.states.shape[0] > 0:
                n = x.states.shape[0]
                first = len(x.context) - 1 - n
                fresh.append((self._seq(x.sequence), x.states, x.context[first + 1 :], first))
        if fresh:
            self._absorb(fresh)

    @torch.no_grad()
    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        self._absorb_inputs(inputs)
        growths: dict[int, _Growth] = {}
        for j, x in enumerate(inputs):
            seq = self._seq(x.sequence)
            if seq.last is not None and budget.grown_nodes >= 2 and budget.grown_depth >= 1:
                growths[j] = _Growth(seq, x.context[-1], len(x.context) - 1, x)
        if growths:
            self._grow(list(growths.values()), budget)
        out = []
        if self.record_states:
            self._predicted = {x.sequence: self._node_states(growths[j]) for j, x in enumerate(inputs) if j in growths}
        for j, x in enumerate(inputs):
            # (a predictor held to no nodes still offers the free drafts, which need no pass)
            tree = self._finish_tree(growths[j], budget) if j in growths else DraftTree.root_only(x.context[-1])
            if self.free is not None and budget.width == 0:
                tree = self.free.merge_into(tree, x, budget)
            out.append(tree)
        return out

    def _node_states(self, gr: _Growth) -> dict[tuple[int, ...], torch.Tensor]:
        """The predicted state (after the output norm) of the root and of every expanded
        candidate, keyed by token path."""
        norm = self.predictor.out_norm
        paths: dict[int, tuple[int, ...]] = {}
        for c in range(len(gr.tok)):  # parents come before their children
            paths[c] = (paths[gr.par[c]] if gr.par[c] >= 0 else ()) + (gr.tok[c],)
        out = {(): norm(gr.seq.last).float()}
        out.update({paths[c]: norm(g).float() for c, g in gr.state.items()})
        return out

    def predicted_states(self, sequence: int) -> dict[tuple[int, ...], torch.Tensor] | None:
        return getattr(self, "_predicted", {}).get(sequence)

    def _grow(self, growths: list[_Growth], budget: TreeBudget) -> None:
        """Grow every tree by cumulative confidence, all sequences in one predictor pass per
        depth: at every depth the ``top_k`` best new nodes of a tree are expanded, until its
        budget (``grown_nodes``) is filled, confidence falls below ``min_confidence`` or
        ``grown_depth`` is reached. With ``budget.width``, a fixed beam of that many nodes per depth."""
        p = self.predictor
        fixed = budget.width > 0
        keep = budget.grown_nodes - 1
        k_top = budget.width if fixed else self.top_k
        least = self.min_confidence if budget.min_confidence is None else budget.min_confidence
        floor = math.log(least) if least > 0 and not fixed else -math.inf
        self.passes += 1
        # Coupled draws are drafted to the depth whose noise the store keeps for every such
        # sequence (drafting and the verify walk then draw each position once); deeper nodes
        # draft by the predictor's distribution. (With a 262k vocabulary the store holds 32
        # positions, and a position takes about 3 ms to draw here.)
        draws = [gr.source.draw for gr in growths if gr.source.draw is not None] if self.follow_draws else []
        draw_depth = noise_capacity(draws[0].vocab) // len(draws) - 1 if draws else 0
        last = torch.stack([gr.seq.last for gr in growths])  # [B, D]
        # per growth, its request's rules over the committed context (None: no growth has rules)
        ruled = self.follow_rules and any(gr.source.rules is not None for gr in growths)
        bases: dict[int, tuple] | None = {} if ruled else None
        val, idx = self._child_top(p.logits(last), [(gr, -1) for gr in growths], bases, 1, draw_depth, k_top)
        for gr, vs, ids in zip(growths, val.tolist(), idx.tolist()):
            gr.frontier = gr.add(-1, 1, 0.0, vs, ids, self._vocab)
            gr.seq.reserve(k_top * budget.grown_depth)
        for depth in range(1, budget.grown_depth):
            live = []
            for gr in growths:
                front = [n for n in gr.frontier if gr.score[n] >= floor]
                if front and not fixed and len(gr.score) >= keep:
                    bar = sorted(gr.score, reverse=True)[keep - 1]
                    front = [n for n in front if gr.score[n] > bar]
                gr.frontier = front
                if front:
                    live.append(gr)
            if not live:
                break
            states, tokens, positions = [], [], []
            for gr in live:
                for n in gr.frontier:
                    states.append(gr.seq.last if gr.par[n] == -1 else gr.state[gr.par[n]])
                    tokens.append(gr.tok[n])
                    positions.append(gr.root_pos - 1 + depth)
            self.passes += 1
            pos = torch.tensor([positions], device=self.device)
            h, q, k, v = p.project(torch.stack(states).unsqueeze(0), torch.tensor([tokens], device=self.device), pos)
            masks = []  # per live tree: (its state, first scratch row, visibility [m, base + m])
            for gr in live:
                m = len(gr.frontier)
                base = len(gr.anc_rows)
                at_rows, at_cols = [], []  # (the visible scratch rows, set in one indexed write)
                for j, n in enumerate(gr.frontier):
                    parent_rows = gr.anc_rows[gr.row_of[gr.par[n]]] if gr.par[n] in gr.row_of else []
                    seen = parent_rows + [base + j]
                    gr.anc_rows.append(seen)
                    gr.row_of[n] = base + j
                    at_rows += [j] * len(seen)
                    at_cols += seen
                mask = torch.zeros(m, base + m, dtype=torch.bool)
                mask[at_rows, at_cols] = True
                masks.append((gr.seq, base, mask.to(self.device)))
            g = self._layers(h, q, k, v, pos, masks)[0]  # [M, D]
            rows = [(gr, n) for gr in live for n in gr.frontier]
            val, idx = self._child_top(p.logits(g), rows, bases, depth + 1, draw_depth, k_top)
            vals, ids = val.tolist(), idx.tolist()
            at = 0
            for gr in live:
                cand = []
                for n in gr.frontier:
                    gr.state[n] = g[at]
                    cand += gr.add(n, depth + 1, gr.score[n], vals[at], ids[at], self._vocab)
                    at += 1
                cand.sort(key=lambda c: -gr.score[c])
                gr.frontier = cand[:k_top]

    def _child_top(self, logits: torch.Tensor, rows: list[tuple[_Growth, int]], bases: dict | None,
                   depth: int, draw_depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best children of each node of ``rows``: their drafted log-probabilities
        and draft-vocabulary indices, both ``[M, k]`` (see :meth:`_child_logp`). Where no
        coupled draw applies at ``depth``, the top ``k`` logits are taken first and only they
        are normalised (less their row's log-sum-exp), instead of the whole log-softmax."""
        k = min(k, logits.shape[-1])
        if depth > draw_depth:
            return top_log_softmax(self._with_rules(logits.float(), rows, bases), k)
        return self._child_logp(logits, rows, bases, depth, draw_depth).topk(k, dim=-1)

    def _child_logp(self, logits: torch.Tensor, rows: list[tuple[_Growth, int]], bases: dict | None,
                    depth: int, draw_depth: int) -> torch.Tensor:
        """The drafted log-probabilities ``[M, Vd]`` (float32) of the children, at tree depth
        ``depth``, of the nodes ``rows`` (``(growth, node)``, a growth's rows together) from
        the predictor's ``logits [M, Vd]``, with each request's rules applied. Coupled draws
        are followed down to ``draw_depth`` (0: not at all).

        Greedy and rejection-sampled sequences draft by the predictor's distribution. A
        sequence drawn by coupled sampling drafts by the draw it will take: the target picks
        ``argmax(log p + g)`` at each position, ``g`` that position's noise, known now. Its
        children are ranked by ``log q + g``, ``q`` the predictor's distribution under
        the request's temperature ``T``, top-k, top-p and min-p: the first child is the token
        the draw gives if the target's distribution is ``q``, and each child's weight,
        ``softmax(T * (log q + g))``, is the chance that the draw picks it if the target's
        logits differ from the predictor's by independent standard Gumbel errors (errors of
        scale ``1 / T`` after the temperature). Those weights are calibrated confidences on
        chat prompts at temperature 1 (``scripts/sampling_ab.py --chains``). Drafting by ``q``
        alone proposes the likeliest token, which a draw at temperature 1 often passes
        over."""
        logp = torch.log_softmax(self._with_rules(logits.float(), rows, bases), dim=-1)
        if depth > draw_depth:
            return logp
        i = 0
        while i < len(rows):
            gr, j = rows[i][0], i + 1
            while j < len(rows) and rows[j][0] is gr:
                j += 1
            draw = gr.source.draw
            if draw is not None:
                scores = torch.log_softmax(processed_logits(logp[i:j], draw.params).double(), dim=-1)
                noise = draw.noise(gr.root_pos + depth)[self._vocab_ids].to(logp.device)
                logp[i:j] = torch.log_softmax((scores + noise) * draw.params.temperature, dim=-1).float()
            i = j
        return logp

    def _with_rules(self, logits: torch.Tensor, rows: list[tuple[_Growth, int]], bases: dict | None) -> torch.Tensor:
        """``logits [M, Vd]`` (float32, over the draft vocabulary) with each row's request
        rules applied as :mod:`sot.logit_rules` applies them to the target's row: bias, then
        the repetition penalty over the prompt and answer, then the frequency and presence
        penalties over the answer, each counting the drafted tokens on the row's path (row
        ``(growth, node)`` predicts the token after ``node``; ``-1``: after the root).
        ``bases`` caches each growth's counts for one tree; ``None``: no row has rules."""
        if bases is None:
            return logits
        x = logits.clone()
        for i, (gr, node) in enumerate(rows):
            rules = gr.source.rules
            if rules is None:
                continue
            if id(gr) not in bases:
                bases[id(gr)] = self._rule_base(gr.source, x.shape[-1])
            counts, seen, bias = bases[id(gr)]
            path = []
            while node >= 0:
                path.append(self._index[gr.tok[node]])
                node = gr.par[node]
            if path:  # (a token twice on the path counts twice)
                at = torch.tensor(path, device=counts.device)
                counts = counts.index_put((at,), torch.ones(len(path), device=counts.device), accumulate=True)
                seen = seen.index_put((at,), torch.ones(len(path), dtype=torch.bool, device=seen.device))
            row = x[i]
            if bias is not None:
                row += bias
            if rules.repetition_penalty != 1.0:
                r = rules.repetition_penalty
                row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
            if rules.frequency_penalty:
                row = row - rules.frequency_penalty * counts
            if rules.presence_penalty:
                row = row - rules.presence_penalty * (counts > 0).float()
            x[i] = row
        return x

    def _rule_base(self, x: DraftInput, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Over the draft vocabulary (``width`` rows), for one request's committed context:
        the answer's token counts ``[Vd]``, the tokens seen in the prompt or the answer
        ``[Vd]`` and the bias ``[Vd]`` (``None`` without one); tokens outside the draft
        vocabulary are never drafted, so they are left out."""
        rules = x.rules
        answer = [self._index[t] for t in x.context[rules.prompt_len:] if t in self._index]
        counts = torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=width).float() if answer \
            else torch.zeros(width)
        seen = counts > 0
        if rules.repetition_penalty != 1.0:
            prompt = [self._index[t] for t in x.context[:rules.prompt_len] if t in self._index]
            if prompt:
                seen[torch.tensor(prompt, dtype=torch.long)] = True
        bias = None
        if rules.logit_bias:
            bias = torch.zeros(width)
            for t, b in rules.logit_bias:
                if t in self._index:
                    bias[self._index[t]] += b
            bias = bias.to(self.device)
        return counts.to(self.device), seen.to(self.device), bias

    @staticmethod
    def _finish_tree(gr: _Growth, budget: TreeBudget) -> DraftTree:
        """The proposed tree: the best ``grown_nodes - 1`` candidates (a parent always scores at
        least as high as its child and ties go to the shallower node, so the set is closed
        under ancestors), or with ``budget.width`` the whole beam."""
        n_cand = len(gr.tok)
        if budget.width > 0:  # the beam: the frontier of every depth, whatever its score
            last = set(gr.frontier)
            chosen = [c for c in range(n_cand) if c in gr.row_of or c in last]
        else:
            chosen = sorted(range(n_cand), key=lambda c: (-gr.score[c], gr.dep[c], c))[: budget.grown_nodes - 1]
        chosen.sort(key=lambda c: (gr.dep[c], c))
        index = {c: i + 1 for i, c in enumerate(chosen)}
        tokens = [gr.root] + [gr.tok[c] for c in chosen]
        parents = [-1] + [0 if gr.par[c] == -1 else index[gr.par[c]] for c in chosen]
        depths = [0] + [gr.dep[c] for c in chosen]
        probs = [1.0] + [math.exp(gr.score[c]) for c in chosen]
        return DraftTree(tokens, parents, depths, probs)
