"""Turning target logits into the distribution that decoding samples from.

Plain decoding and tree verification call the same functions on bit-identical logits, so
temperature, top-k, top-p and min-p act identically in both.
"""
from __future__ import annotations

import enum
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sot.kernels import cpu_kernels


class SamplingMode(str, enum.Enum):
    """How tokens are drawn when ``temperature > 0``. Both draw exactly from the target's
    distribution and accept a drafted token with the same probability.

    ``coupled`` (the default) takes the Gumbel-max of the logits with noise keyed to (seed,
    sequence, position), so a seeded sample is the same text whatever was drafted, whatever
    the batch and whatever the commit policy decided: it equals seeded plain decoding's
    token for token. ``rejection`` (recursive rejection sampling) draws from the request's
    random stream, whose use depends on the drafted trees, so the same seed can give another
    sample when the drafts differ (another earlier answer in the suffix store, another
    decision timed on a busier machine).
    """

    REJECTION = "rejection"
    COUPLED = "coupled"


#: temperatures below this decode greedily (vLLM's rule): dividing logits by a smaller one
#: overflows float32, and the distribution is the argmax's to within rounding anyway
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy. The penalties and the bias
    change the logits before temperature, top-k, top-p and min-p, in greedy decoding too
    (:mod:`sot.logit_rules`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    #: drop tokens less likely than ``min_p`` times the most likely one (after top-k and
    #: top-p, as transformers orders them; 0: off)
    min_p: float = 0.0
    seed: int = 0
    mode: SamplingMode = SamplingMode.COUPLED
    #: over the prompt and the answer: a seen token's logit is divided by it when positive,
    #: multiplied by it otherwise (1: none)
    repetition_penalty: float = 1.0
    #: over the answer: subtracted from a token's logit once per time it occurs
    frequency_penalty: float = 0.0
    #: over the answer: subtracted from the logit of every token that occurs
    presence_penalty: float = 0.0
    #: ``(token, bias)`` pairs added to the logits
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax: temperature 0, or one below
        :data:`GREEDY_BELOW` (whose scaled logits would overflow float32), as vLLM treats it."""
        return self.temperature < GREEDY_BELOW


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to ``logits [N, V]``, in that order;
    removed entries are -inf."""
    scores = logits.float() / params.temperature
    # a logit pushed past float32's range (a tiny repetition penalty) is the largest one
    # there is, not +inf, whose softmax would be NaN
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (keep at least one).
        drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop_sorted[..., 0] = False  # (a top_p that rounds to 0 in float32 would drop them all)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values  # the most likely token always stays
        scores = scores.masked_fill(probs < floor, float("-inf"))
    return scores


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution ``[N, V]`` (float64 for exact residual arithmetic)."""
    return torch.softmax(processed_logits(logits, params).double(), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from the unnormalised non-negative weights ``probs [V]`` by inverting
    their cumulative sum with one uniform number: exact, and much cheaper than
    ``torch.multinomial`` over a large vocabulary on CPU (about 0.1 against 1.4 ms at 49k
    entries). An index of zero weight is never drawn."""
    cdf = probs.cumsum(0)
    u = torch.rand((1,), generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    # the first index whose cumulative weight exceeds u: a zero-weight index never is, since
    # its cumulative weight equals its predecessor's
    i = int(torch.searchsorted(cdf, u, right=True).item())
    if i >= cdf.shape[0]:  # u rounded up to the total: the last index with weight
        i = int(torch.nonzero(probs > 0).flatten()[-1].item())
    return i


def _key(seed: int, sequence: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{sequence}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


#: bytes of Gumbel noise kept for reuse (:func:`gumbel_noise`): a position's noise is drawn
#: once when a drafter that follows it drafts there and the verify walk then reads it (about
#: 0.7 ms a position at a 49k vocabulary on a 2-core EPYC); 64 MB hold about 170 positions
#: of a 49k vocabulary, 16 sequences drafting 8 deep and the walks behind them
NOISE_CACHE_BYTES = 64 << 20


class _NoiseCache:
    """The most recently used noise vectors, least recent dropped first past the byte cap;
    safe to share between threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: OrderedDict[tuple[int, int, int, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int, int, int]) -> torch.Tensor | None:
        with self._lock:
            noise = self._entries.get(key)
            if noise is not None:
                self._entries.move_to_end(key)
            return noise

    def put(self, key: tuple[int, int, int, int], noise: torch.Tensor) -> None:
        size = noise.numel() * noise.element_size()
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            self._entries[key] = noise
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()


_noise_cache = _NoiseCache(NOISE_CACHE_BYTES)


def noise_capacity(vocab: int) -> int:
    """How many positions' noise of a ``vocab``-wide vocabulary the store keeps (a drafter
    that needs more each step would draw them again and again)."""
    return _noise_cache.max_bytes // (8 * max(1, vocab))


def gumbel_noise(seed: int, sequence: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise ``[V]`` (float64) determined only by ``(seed, sequence, position)``. The
    vector returned may be shared with later calls for the same key: do not write to it."""
    key = (seed, sequence, position, vocab)
    noise = _noise_cache.get(key)
    if noise is None:
        gen = torch.Generator().manual_seed(_key(seed, sequence, position))
        uniform = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
        noise = uniform.log_().neg_().log_().neg_()
        _noise_cache.put(key, noise)
    return noise


@dataclass(frozen=True)
class CoupledDraw:
    """What fixes a coupled-sampled sequence's token at every position ahead of it: its
    settings, its key (the request's label, ``index``) and the width ``vocab`` of the
    target's logits. The token at ``position`` is the argmax of the target's processed
    log-probabilities plus :meth:`noise` there, so a drafter that knows the noise can propose
    the token the draw would give if the target's distribution were its own."""

    params: SamplingParams
    index: int
    vocab: int

    def noise(self, position: int) -> torch.Tensor:
        """The Gumbel noise ``[vocab]`` (float64, shared: read only) of ``position``."""
        return gumbel_noise(self.params.seed, self.index, position, self.vocab)

    @classmethod
    def of(cls, params: SamplingParams, index: int, vocab: int) -> "CoupledDraw | None":
        """The draw of a sequence with these settings; ``None`` where its tokens are not
        drawn by coupled sampling (greedy decoding, rejection sampling)."""
        if params.greedy or params.mode is not SamplingMode.COUPLED:
            return None
        return cls(params, index, vocab)


def sequence_generator(seed: int, sequence: int) -> torch.Generator:
    """The random stream of one sequence in rejection mode."""
    return torch.Generator().manual_seed(_key(seed, sequence, -1))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model, with the most likely tokens at
    its position: the log-softmax of the raw logits (before temperature, top-k and top-p), as
    vLLM reports them by default.

    Attributes:
        token: the generated token.
        logprob: its log probability.
        top: ``(token, log probability)`` of the most likely tokens, most likely first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


#: most alternatives a request may ask for per token
MAX_TOP_LOGPROBS = 20


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of each of ``tokens`` given ``logits [n, V]``, the rows that
    decided them (row ``i`` decided ``tokens[i]``), with ``top`` alternatives each. The rows
    are the ones plain decoding computes, bit for bit, so the figures are too."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, idx.tolist(), vals.tolist())]


#: the largest ``k`` that :func:`top_log_softmax` takes to the compiled kernel, which keeps its
#: top ``k`` sorted by insertion (a draft tree asks for 8 children a node)
TOP_KERNEL_MAX_K = 32


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` -> ``[...]`` the index of each row's largest value (the first on
    ties), the same as ``argmax`` on the logits' own dtype. bfloat16 rows are compared in
    float32 (exact), where PyTorch's CPU argmax is vectorized (about 4x faster at a 49k
    vocabulary). On a CPU with SoT's kernels, float32 rows take their compiled argmax
    (``row_argmax_f32``; on an AVX2 EPYC one 49k row 53 -> 18 us, 16 rows 0.47 -> 0.05 ms),
    which gives a row's first NaN where it has NaNs (PyTorch gives one of them)."""
    rows = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() > 0 and rows.shape[-1] > 0:
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.row_argmax_f32(rows.reshape(-1, rows.shape[-1])).view(rows.shape[:-1])
    return rows.argmax(dim=-1)


def top_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [M, V]`` (float32) -> ``(values, indices)``, both ``[M, k]``: each row's ``k``
    largest log-softmax values, largest first, and their indices; what ``log_softmax`` then
    ``topk`` give, without the whole log-softmax. On a CPU with SoT's kernels one pass per row
    finds the top ``k`` and a second sums the exponentials (``row_top_logsoftmax_f32``; ties
    go to the lower index, and a row with a NaN gives NaN values); elsewhere PyTorch's
    ``topk`` less ``logsumexp``."""
    k = min(k, logits.shape[-1])
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and 0 < k <= TOP_KERNEL_MAX_K and logits.shape[0] > 0):
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.row_top_logsoftmax_f32(logits, k)
    val, idx = logits.topk(k, dim=-1)
    return val - torch.logsumexp(logits, dim=-1, keepdim=True), idx
