"""Running a Hugging Face causal LM over a draft tree.

The generic path works for any decoder-only model whose attention goes through transformers'
attention interface: SoT registers its own attention function (``"sot"``), which writes the
new rows' K/V into :class:`sot.cache.KVCache` and attends with :mod:`sot.attention`. Every
linear layer is swapped for a row-stable one (SoT's float32 kernel, row-invariant at any row
count, or fixed blocks of ``ROW_UNIT`` rows where a library kernel needs them), so a row's
result never depends on how many rows share the pass.
"""
from __future__ import annotations

import contextvars
import importlib.util
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Iterator

import torch

from sot.attention import TreeLayout, tree_attention, use_kernel
from sot.cache import KVCache
from sot.errors import ConfigError, UnsupportedModelError
from sot.kernels import cpu_kernels
from sot.kernels.linear import PackedLinear, fused_rms_norm
from sot.models.fast_llama import FAST_FAMILIES, FastLlama, fast_path_gap
from sot.models.graphs import VerifyGraphs
from sot.models.loading import INT8_ATTR, KV_CACHE_DTYPES, KV_FLOAT16_NEEDS_FLOAT32, dtype_name
from sot.models.rows import ROW_UNIT
from sot.models.support import unsupported_reason
from sot.packing import pack_trees
from sot.prefix_cache import PREFILL_CHUNK
from sot.sampling import row_argmax
from sot.tree import DraftTree, chain_tree

ATTN_NAME = "sot"

_row_stable = contextvars.ContextVar("sot_row_stable", default=False)


@contextmanager
def row_stable() -> Iterator[None]:
    """Within this context, row-stable linears multiply in blocks of ``ROW_UNIT`` rows."""
    token = _row_stable.set(True)
    try:
        yield
    finally:
        _row_stable.reset(token)


def _packed(module: torch.nn.Module, weight_nk: Callable[[], torch.Tensor]) -> PackedLinear:
    """The module's weight packed once for row-stable products (the fast path's kernels),
    re-packed if the parameter was replaced or changed in place."""
    int8 = getattr(module, "_sot_int8", False)
    key = (module.weight.data_ptr(), module.weight._version, int8)
    cached = getattr(module, "_sot_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, PackedLinear(weight_nk(), module.bias, int8=int8))
        module._sot_packed = cached
    return cached[1]


class RowStableLinear(torch.nn.Linear):
    """``nn.Linear`` whose output rows do not depend on the other rows in the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # (no row: a verify pass whose logits are computed later)
            return x.new_empty(*x.shape[:-1], self.out_features)
        flat = x.reshape(-1, x.shape[-1])  # (outside verify passes: SoT's kernel where it runs, else F.linear)
        return _packed(self, lambda: self.weight)(flat, stable=_row_stable.get()).view(*x.shape[:-1], -1)


def _stable_conv1d_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # transformers' Conv1D stores weight as [K, N].
    if not _row_stable.get():
        size_out = x.size()[:-1] + (module.nf,)
        return torch.addmm(module.bias, x.view(-1, x.size(-1)), module.weight).view(size_out)
    flat = x.reshape(-1, x.shape[-1])
    return _packed(module, lambda: module.weight.t())(flat, stable=True).view(*x.shape[:-1], -1)


def make_row_stable(model: torch.nn.Module, int8: bool = False) -> None:
    """Swap every ``nn.Linear`` (and GPT-2 ``Conv1D``) of ``model`` for a row-stable version
    (``int8``: its products in 8-bit integers where its weight is a grid of GGUF blocks).

    Parameters are shared, not copied; tied embeddings stay tied.
    """
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if type(module) in (torch.nn.Linear, RowStableLinear):
            module.__class__ = RowStableLinear
            module._sot_int8 = int8
        elif isinstance(module, Conv1D):
            module.forward = _stable_conv1d_forward.__get__(module)


_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
#: Gemma 3's ``(1 + w)`` norms, which the compiled float32 kernel computes with ``1 + w`` as its weight
_ONE_PLUS_NORM_CLASSES = ("Gemma3RMSNorm",)


def use_fused_norms(model: torch.nn.Module) -> None:
    """On the CPU (bfloat16 or float32), run Llama-style RMSNorm modules through the compiled
    kernel that the fast path uses, so both paths compute the same bits; Gemma 3's norms too,
    in float32 (:func:`sot.models.fast_llama.fast_path_gap`)."""
    for module in model.modules():
        kind = type(module).__name__
        if kind in _NORM_CLASSES:
            fused = fused_rms_norm(module.weight.dtype, module.weight.device)
            if fused is not None:
                eps = module.variance_epsilon
                module.forward = lambda x, _w=module.weight, _f=fused, _e=eps: _f(x, _w, _e, None)[0]
        elif kind in _ONE_PLUS_NORM_CLASSES and module.weight.dtype == torch.float32:
            fused = fused_rms_norm(module.weight.dtype, module.weight.device)
            if fused is not None:
                weight = 1.0 + module.weight.detach().float()  # (as the module computes it)
                module.forward = lambda x, _w=weight, _f=fused, _e=module.eps: _f(x, _w, _e, None)[0]


@dataclass(frozen=True)
class ForwardContext:
    """What the attention function needs for one forward: the cache and the row layout."""

    cache: KVCache
    layout: TreeLayout


def sot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sot_context: ForwardContext | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: ``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]``.

    Returns ``([B, T, H, D], None)``.
    """
    if sot_context is None:
        raise RuntimeError("the 'sot' attention implementation needs a ForwardContext (run through SoT's engine)")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # transformers passes a layer's window (Mistral, Qwen2/3, Gemma 2/3 sliding layers) and
    # its attention-logit soft cap (Gemma 2) as keyword arguments.
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    cache, layout = sot_context.cache, sot_context.layout
    cache.write(layer, layout.write_slots, key, value, layout.write_rows)
    out = tree_attention(query, cache, layer, layout, scale, window, softcap)
    return out.to(query.dtype), None


@contextmanager
def transformers_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within this context a model wrapped by :class:`TargetModel` runs transformers' own
    attention (for a plain forward outside the engine, e.g. the states of a finished text)."""
    previous = model.config._attn_implementation
    if previous != ATTN_NAME:
        yield
        return
    model.set_attn_implementation("eager")  # every family has it (Gemma 2's soft cap has no SDPA)
    try:
        yield
    finally:
        model.set_attn_implementation(ATTN_NAME)


def register_attention() -> None:
    """Register ``"sot"`` with transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, sot_attention)


#: model types whose causal LM computes its logits as ``lm_head(final states)``, then at most
#: Gemma 2's final soft cap (their transformers forwards, read for this): on the CPU their verify
#: passes leave the head to compute the rows acceptance reads
LAZY_HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                                "gpt2", "gpt_neox"})


class ForwardOutput:
    """Logits and chosen hidden states of one forward.

    The logits of a verify pass may be left to compute on demand (``hidden`` and ``head``):
    most of a tree's rows are rejected, and the LM head over a large vocabulary is a good part
    of a row's cost. A row's logits have the same bits whichever rows are computed with it
    (the head's products are row-stable), so reading only the rows an acceptance walks
    (:meth:`argmax_rows`, :meth:`seq_logits`) changes no result.

    Attributes:
        logits: ``[B, T, V]`` in the model dtype, or ``[R, V]`` for a flat-packed pass (with a
            head left to compute, every row is computed on first access).
        states: ``[B, T, S, D]`` hidden states of the ``S`` requested layers (``[R, S, D]``
            flat), or ``None``.
        offsets: for a flat-packed pass, sequence ``b``'s rows are ``offsets[b] .. offsets[b + 1]``.
    """

    def __init__(self, logits: torch.Tensor | None = None, states: torch.Tensor | None = None,
                 offsets: tuple[int, ...] | None = None, hidden: torch.Tensor | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``hidden`` ``[B, T, D]`` or ``[R, D]`` (flat): the final normed states, whose logits
        ``head`` computes (``[n, D] -> [n, V]``) where ``logits`` is not given."""
        if logits is None and (hidden is None or head is None):
            raise ValueError("a forward output needs its logits, or the hidden states and the head that gives them")
        self._rows = _LogitRows(logits, hidden, head)
        self.states = states
        self.offsets = offsets

    @property
    def logits(self) -> torch.Tensor:
        return self._rows.all()

    @property
    def lazy(self) -> bool:
        """Whether the logits are computed on demand and not all have been yet."""
        return self._rows.logits is None

    @property
    def head_rows(self) -> int:
        """Rows the LM head computed so far, when on demand (``-1``: computed with the pass)."""
        return self._rows.computed

    @property
    def head_seconds(self) -> float:
        """Wall time of the LM head's calls on demand so far (0 when computed with the pass)."""
        return self._rows.seconds

    def with_states(self, states: torch.Tensor | None) -> "ForwardOutput":
        """The same pass (its logits shared, computed once) with other ``states``."""
        out = ForwardOutput.__new__(ForwardOutput)
        out._rows, out.states, out.offsets = self._rows, states, self.offsets
        return out

    def seq_start(self, b: int) -> int:
        """Index of sequence ``b``'s first row among the pass's rows (flattened ``[B * T]`` when
        padded)."""
        if self.offsets is not None:
            return self.offsets[b]
        return b * self._rows.rows_per_seq()

    def seq_logits(self, b: int) -> torch.Tensor:
        """``[T_b, V]`` the logits rows of sequence ``b`` (its tree's nodes first)."""
        if not self.lazy:
            logits = self.logits
            return logits[b] if self.offsets is None else logits[self.offsets[b] : self.offsets[b + 1]]
        end = self.offsets[b + 1] if self.offsets is not None else self.seq_start(b + 1)
        return self._rows.span(self.seq_start(b), end)

    def argmax_rows(self, rows: list[int]) -> list[int]:
        """The argmax of each of ``rows`` (indices into the pass's rows, see :meth:`seq_start`),
        computing only those rows' logits where they are not computed yet."""
        return self._rows.argmax(rows)

    def row(self, index: int) -> torch.Tensor:
        """``[V]`` the logits of one of the pass's rows (see :meth:`seq_start`), computed
        where they are not yet."""
        return self._rows.row(index)

    def prefetch(self, rows: list[int]) -> None:
        """Compute the logits of ``rows`` now, in one call of the head, where the pass left
        them to compute (a no-op otherwise)."""
        self._rows.ensure(rows)

    def rows(self, rows: list[int]) -> torch.Tensor:
        """``[n, V]`` the logits of ``rows`` (indices into the pass's rows, see :meth:`seq_start`),
        computing only those where the pass left them to compute."""
        return self._rows.pick(rows)

    def seq_states(self, b: int) -> torch.Tensor:
        """``[T_b, S, D]`` the requested states of sequence ``b``'s rows."""
        return self.states[b] if self.offsets is None else self.states[self.offsets[b] : self.offsets[b + 1]]

    def path_states(self, paths: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence ``b``, the states of its rows ``paths[b]`` (``[len(paths[b]), S, D]``):
        ``[seq_states(b)[paths[b]] for b ...]``, gathered in one copy for the whole batch
        (a copy a sequence cost more than the rows it moved)."""
        rows = self.states.flatten(0, 1) if self.offsets is None else self.states
        width = self.states.shape[1] if self.offsets is None else 0
        index = [(self.offsets[b] if self.offsets is not None else b * width) + i
                 for b, path in enumerate(paths) for i in path]
        picked = rows.index_select(0, torch.tensor(index, dtype=torch.long, device=rows.device))
        return list(picked.split([len(path) for path in paths]))


class _LogitRows:
    """A pass's logits, given whole or computed from the final hidden states on demand (each
    row once, kept with its argmax)."""

    def __init__(self, logits: torch.Tensor | None, hidden: torch.Tensor | None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.logits = logits
        self.hidden = hidden
        self.head = head
        self.computed = -1 if logits is not None else 0
        self.seconds = 0.0
        self._row: dict[int, torch.Tensor] = {}  # flat row -> its logits [V]
        self._argmax: dict[int, int] = {}

    def rows_per_seq(self) -> int:
        source = self.logits if self.logits is not None else self.hidden
        return source.shape[1] if source.dim() == 3 else source.shape[0]

    def _flat(self) -> torch.Tensor:
        return self.logits.reshape(-1, self.logits.shape[-1])

    def ensure(self, rows: list[int]) -> None:
        """Compute the rows among ``rows`` not computed yet, in one call of the head."""
        if self.logits is not None:
            return
        missing = sorted({r for r in rows if r not in self._row})
        if not missing:
            return
        t0 = perf_counter()
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        with torch.inference_mode():
            block = self.head(hidden[torch.tensor(missing, dtype=torch.long, device=hidden.device)])  # [n, V]
        self.seconds += perf_counter() - t0
        self.computed += len(missing)
        self._row.update(zip(missing, block))
        self._argmax.update(zip(missing, row_argmax(block).tolist()))  # (most rows read are greedy walks')

    def all(self) -> torch.Tensor:
        if self.logits is None:
            t0 = perf_counter()
            hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
            self.computed += hidden.shape[0]
            with torch.inference_mode():
                self.logits = self.head(hidden).view(*self.hidden.shape[:-1], -1)
            self.seconds += perf_counter() - t0
            self._row.clear()
        return self.logits

    def span(self, start: int, end: int) -> torch.Tensor:
        if self.logits is not None:
            return self._flat()[start:end]
        return self.pick(list(range(start, end)))

    def row(self, r: int) -> torch.Tensor:
        if self.logits is not None:
            return self._flat()[r]
        self.ensure([r])
        return self._row[r]

    def pick(self, rows: list[int]) -> torch.Tensor:
        if self.logits is not None:
            return self._flat()[rows]
        self.ensure(rows)
        return torch.stack([self._row[r] for r in rows])

    def argmax(self, rows: list[int]) -> list[int]:
        missing = sorted({r for r in rows if r not in self._argmax})
        if missing and self.logits is not None:  # (every row's, in one call)
            self._argmax.update(enumerate(row_argmax(self._flat()).tolist()))
        elif missing:
            self.ensure(missing)
        return [self._argmax[r] for r in rows]


class TreeRows:
    """The logits rows of one sequence's tree in a pass, for an acceptance walk: ``rows[i]``
    (``[V]``) or ``rows[i : i + 1]`` (``[1, V]``) is node ``i``'s row. Where the pass left its
    logits to compute, a row not computed yet is computed with the rest of the most confident
    chain below it (the rows a walk that reached it goes on to read, most likely)."""

    def __init__(self, out: ForwardOutput, b: int, tree: DraftTree) -> None:
        self.out, self.tree, self.start = out, tree, out.seq_start(b)
        self._kids: list[list[int]] | None = None
        self._conf: list[float] | None = None

    @property
    def children(self) -> list[list[int]]:
        """``children[i]``: the nodes whose parent is ``i`` (the tree's, computed once)."""
        if self._kids is None:
            self._kids = self.tree.children()
        return self._kids

    def chain(self, node: int) -> list[int]:
        """``node`` and the most confident chain of its descendants."""
        kids = self.children
        if self._conf is None:
            self._conf = self.tree.confidences()
        conf = self._conf
        chain = [node]
        while kids[node]:
            node = max(kids[node], key=lambda c: conf[c])
            chain.append(node)
        return chain

    def dim(self) -> int:
        return 2

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, V)``: the tree's nodes, the vocabulary."""
        return self.tree.size, self[0].shape[-1]

    def __getitem__(self, key: int | slice) -> torch.Tensor:
        if isinstance(key, slice):
            start = key.start or 0
            if key.step not in (None, 1) or key.stop != start + 1:
                raise IndexError("tree rows are read one node at a time: rows[i] or rows[i : i + 1]")
            return self[start][None]
        node = int(key)
        if not 0 <= node < self.tree.size:
            raise IndexError(f"node {node} is not in a tree of {self.tree.size} nodes")
        if not self.out.lazy:
            return self.out.row(self.start + node)
        self.out.prefetch([self.start + n for n in self.chain(node)])
        return self.out.rows([self.start + node])[0]


def longrope_limit(config: object) -> int | None:
    """The positions a model with 'longrope' RoPE (Phi-3 128k, Phi-3.5) decodes with its short
    factors: transformers picks short or long factors for a whole pass by its last position, so
    past this a pass's rows depend on what shares it. ``None``: no such RoPE."""
    params = getattr(config, "rope_parameters", None) or {}
    groups = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    limits = [int(g.get("original_max_position_embeddings")
                  or getattr(config, "original_max_position_embeddings", 0) or 0)
              for g in groups if isinstance(g, dict) and g.get("rope_type") == "longrope"]
    return min((x for x in limits if x > 0), default=None)


class TargetModel:
    """A causal LM wrapped for tree verification (the generic path).

    The wrapper takes the model over: its attention is switched to SoT's (which runs only
    inside the engine's passes) and its linear layers and norms to row-stable ones, so the
    model itself no longer runs outside SoT (its ``forward`` and ``generate`` raise). Load
    a second copy for use elsewhere.

    Args:
        model: a transformers causal LM, already in its final dtype and device.
        state_layers: indices into ``hidden_states`` (0 = embeddings) to return with each
            forward; empty when the drafter needs none.
        fast: run Llama-family models through :class:`FastLlama` (SoT's own forward).
        cuda_graphs: on a CUDA GPU, replay verify passes as CUDA graphs
            (:mod:`sot.models.graphs`; ``SOT_NO_CUDA_GRAPHS=1`` also turns them off).
        kv_cache_dtype: the KV cache's dtype (:data:`~sot.models.loading.KV_CACHE_DTYPES`):
            ``auto`` (float32, or bfloat16 for a bfloat16 model), or, where SoT's CPU attention
            runs, ``bfloat16`` or ``float16`` for a float32 model (half the bytes attention reads;
            the keys and values are rounded, so answers may differ from float32's, and
            speculation stays exact) and ``float32`` for a bfloat16 one.
    """

    def __init__(self, model: torch.nn.Module, state_layers: tuple[int, ...] = (), fast: bool = True,
                 cuda_graphs: bool = True, kv_cache_dtype: str = "auto") -> None:
        config = model.config
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"SoT cannot decode {type(model).__name__} exactly: {reason}")
        register_attention()
        try:
            model.set_attn_implementation(ATTN_NAME)
        except Exception as exc:  # noqa: BLE001
            raise UnsupportedModelError(
                f"{type(model).__name__} does not support custom attention functions: {exc}"
            ) from exc
        #: products in 8-bit integers over the GGUF blocks (``--dtype int8``, set by load_model)
        self.int8 = bool(getattr(model, INT8_ATTR, False))
        make_row_stable(model, self.int8)
        use_fused_norms(model)
        self.model = model
        self.config = config
        self.state_layers = tuple(state_layers)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = text.num_hidden_layers
        self.num_heads = text.num_attention_heads
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        limit = longrope_limit(text)
        if limit is not None and (self.max_positions is None or limit < self.max_positions):
            warnings.warn(f"this model's 'longrope' RoPE turns every position's rotation to its long factors once a "
                          f"pass reaches past {limit} positions, so a draft or another sequence of the batch would "
                          f"change the answer; SoT decodes it within its first {limit} positions (its context "
                          f"would be {self.max_positions})", RuntimeWarning, stacklevel=2)
            self.max_positions = limit
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        #: SoT's compiled CPU attention runs for this model here (its KV cache has tiled keys)
        self.cpu_attention = (self.device.type == "cpu" and self.head_dim % 16 == 0  # the kernel's lanes and limits
                              and self.head_dim <= 256 and self.num_heads // self.num_kv_heads <= 16
                              and cpu_kernels() is not None)
        #: the KV cache's dtype
        self.kv_dtype = self._kv_dtype(kv_cache_dtype)
        if self.device.type == "cuda" and importlib.util.find_spec("triton") is None:
            warnings.warn("Triton is not installed: attention on the GPU runs through PyTorch, whose rows can round "
                          "differently by what shares a verify pass, so an answer may differ from plain decoding's "
                          "in rare near-ties (pip install triton)", RuntimeWarning, stacklevel=2)
        self.fast = None
        if fast and getattr(config, "model_type", "") in FAST_FAMILIES and fast_path_gap(model) is None:
            self.fast = FastLlama(model, int8=self.int8)
            if self.int8 and not self.fast.int8_products:
                warnings.warn("--dtype int8 multiplies weights in blocks of 32 inputs; no weight of this model has a "
                              "multiple of 32 inputs, so its products run in float32", RuntimeWarning, stacklevel=2)
        #: the LM head's module and its final-logit soft cap (Gemma 2), for logits computed on demand
        self._head = model.get_output_embeddings()
        #: the width of a logits row (the head's outputs; some models pad it past the vocabulary)
        self.logits_width = int(getattr(self._head, "out_features", 0) or self.vocab_size)
        self._softcap = getattr(text, "final_logit_softcapping", None)
        #: verify passes leave each row's logits to be computed when read (:class:`ForwardOutput`):
        #: on the CPU, through SoT's forward or a family whose head is a row-stable linear product
        #: (and Gemma's soft cap, element by element); ``SOT_EAGER_HEAD=1`` computes every row
        self.lazy_head = (self.device.type == "cpu" and os.environ.get("SOT_EAGER_HEAD") != "1"
                          and (self.fast is not None or (getattr(config, "model_type", "") in LAZY_HEAD_FAMILIES
                                                         and isinstance(self._head, RowStableLinear))))
        #: a verify pass's rows per sequence must be a multiple of this
        self.row_multiple = self.fast.row_multiple if self.fast is not None else ROW_UNIT
        #: the CUDA graphs of verify passes, or ``None`` (not on a GPU, or turned off)
        self.graphs = (VerifyGraphs() if cuda_graphs and self.device.type == "cuda"
                       and os.environ.get("SOT_NO_CUDA_GRAPHS") != "1" else None)

    def weight_storage(self) -> dict[str, tuple[int, int]]:
        """How the lean forward's products hold their weights (:attr:`PackedLinear.storage`):
        ``{kind: (weights, bytes a one-row pass reads)}``; empty on the generic path, whose
        products pack on first use."""
        if self.fast is None:
            return {}
        out: dict[str, tuple[int, int]] = {}
        products = [self.fast.lm_head] + [lin for lay in self.fast.layers for lin in (lay.qkv, lay.o, lay.gate_up,
                                                                                      lay.down)]
        for piece in (piece for lin in products for piece in lin.pieces):
            kind, size = piece.storage
            weights, total = out.get(kind, (0, 0))
            out[kind] = (weights + piece.weight.numel(), total + size)
        return out

    def synchronize(self) -> None:
        """Wait for the work queued on the target's device (a CUDA GPU runs it
        asynchronously), so that a wall-clock reading after this call includes it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def packs_flat(self, cache: KVCache) -> bool:
        """Whether verify passes against ``cache`` compute only the trees' real rows (flat
        packing, :class:`~sot.attention.TreeLayout`); otherwise every sequence's rows are
        padded to the largest tree of the pass."""
        return self.fast is not None and use_kernel(cache)

    def _kv_dtype(self, name: str) -> torch.dtype:
        """The KV cache's dtype for ``kv_cache_dtype=name``. With the compiled CPU kernel the
        cache holds float32, or bfloat16 for a bfloat16 model (whose keys and values are bfloat16
        values: half the bytes to read, the same numbers), unless asked otherwise; elsewhere the
        model's dtype. Attention accumulates in float32 either way."""
        if name not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
        if not self.cpu_attention:
            if name not in ("auto", dtype_name(self.dtype)):
                raise ConfigError(f"--kv-cache-dtype {name} needs SoT's CPU attention (a head dim that is a multiple "
                                  f"of 16, at most 256, on the CPU); here the cache holds the model's "
                                  f"{dtype_name(self.dtype)}: use auto")
            return self.dtype
        own = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        chosen = KV_CACHE_DTYPES[name] or own
        if own == torch.bfloat16 and chosen == torch.float16:
            raise ConfigError(KV_FLOAT16_NEEDS_FLOAT32)
        return chosen

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """A KV cache for ``batch_size`` sequences of up to ``capacity`` slots (tiled keys and
        :attr:`kv_dtype` where SoT's CPU attention runs)."""
        return KVCache(self.num_layers, batch_size, self.num_kv_heads, self.head_dim, capacity, self.device,
                       self.kv_dtype, tiled_keys=self.cpu_attention)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
             last_row: int | None = None) -> ForwardOutput:
        """One verify forward; with ``last_row``, only that row's logits (``[1, V]``)."""
        if self.fast is not None:
            lazy = self.lazy_head and last_row is None
            out, states = self.fast.forward(input_ids, positions, context.cache, context.layout, self.state_layers,
                                            last_row, head=not lazy)
            flat = self.fast.flattens(context.layout, context.cache)
            offsets = context.layout.flat_offsets if flat else None
            if lazy:
                return ForwardOutput(states=states, offsets=offsets, hidden=out, head=self.fast.logits)
            return ForwardOutput(logits=out, states=states, offsets=offsets)
        want_states = bool(self.state_layers)
        lazy = self.lazy_head  # (a prefill's last row too: every row's logits from _logits)
        kept: list[torch.Tensor] = []

        def keep_states(module: torch.nn.Module, args: tuple) -> tuple:  # the head's input, [B, T, D]
            kept.append(args[0])
            return (args[0][..., :0, :], *args[1:])  # (the head runs on no row)

        hook = self._head.register_forward_pre_hook(keep_states) if lazy else None
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=False,
                output_hidden_states=want_states,
                sot_context=context,
            )
        finally:
            if hook is not None:
                hook.remove()
        states = None
        if want_states:
            states = torch.stack([out.hidden_states[i] for i in self.state_layers], dim=2)
        if lazy and last_row is not None:
            with torch.inference_mode():
                return ForwardOutput(logits=self._logits(kept[-1][0, last_row:last_row + 1]), states=states)
        if lazy:
            return ForwardOutput(states=states, hidden=kept[-1], head=self._logits)
        logits = out.logits if last_row is None else out.logits[0, last_row:last_row + 1]
        return ForwardOutput(logits=logits, states=states)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [n, D]`` the final normed states -> logits ``[n, V]``, as the model's forward
        computes them after its last norm (:data:`LAZY_HEAD_FAMILIES`)."""
        with row_stable():  # (as inside the pass)
            logits = self._head(h)
        if self._softcap is not None:
            # Gemma 2's order of operations, one row at a time: an element's result then does
            # not depend on how many rows the call holds (where a vector loop's tail falls)
            for row in logits:
                row.div_(self._softcap).tanh_().mul_(self._softcap)
        return logits

    @torch.inference_mode()
    def prefill(self, cache: KVCache, batch_index: int, input_ids: torch.Tensor, start: int = 0,
                on_rows: Callable[[torch.Tensor, int], None] | None = None) -> ForwardOutput:
        """Read prompt tokens ``input_ids [T]`` of one sequence into its cache slots from
        ``start`` (its committed length becomes ``start + T``). Returns the last row's logits
        ``[1, 1, V]`` (the first new token's distribution, the only one a prompt is read for)
        and the states ``[1, T, S, D]``.

        The tokens go through verify passes, as chains of at most ``PREFILL_CHUNK`` rows: each
        row is computed exactly as plain decoding computes its token, so a prompt's rows and
        a decoded answer's are interchangeable bit for bit, however the prompt is split (what
        lets the prefix cache reuse earlier answers, :mod:`sot.prefix_cache`).

        ``on_rows(logits, offset)``, when given, receives every row's logits ``[n, V]`` of each
        chunk, ``offset`` its first token's index in ``input_ids`` (for prompt log
        probabilities; the LM head is row-stable, so they are the rows decoding would give)."""
        ids = input_ids.tolist()
        if not ids:
            raise ValueError("prefill needs at least one token")
        view = cache.single(batch_index)
        states = []
        for s in range(0, len(ids), PREFILL_CHUNK):
            piece = ids[s:s + PREFILL_CHUNK]
            view.lengths[0] = start + s
            batch = pack_trees([chain_tree(piece[0], piece[1:])], view, self)
            with row_stable():
                # (on a GPU a whole chunk's grid replays as a CUDA graph; shorter ones run eagerly)
                out = self._pass(view, batch.ids, batch.positions, batch.layout,
                                 last_row=None if on_rows else len(piece) - 1,
                                 graph=batch.ids.shape[1] == PREFILL_CHUNK)
            last = out.logits
            if on_rows is not None:
                rows = out.seq_logits(0)[:len(piece)]
                on_rows(rows, s)
                last = rows[-1:]
            if out.states is not None:
                states.append(out.seq_states(0)[:len(piece)])
        cache.lengths[batch_index] = start + len(ids)
        whole = (states[0] if len(states) == 1 else torch.cat(states))[None] if states else None
        return ForwardOutput(logits=last.reshape(1, 1, -1), states=whole)

    def _pass(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, layout: TreeLayout,
              last_row: int | None = None, graph: bool = True) -> ForwardOutput:
        """One pass over ``input_ids, positions [B, T]``: replayed as a CUDA graph where one
        applies (computing every row's logits, of which only ``last_row``'s are kept when
        given), else eagerly; each row has the same bits either way."""
        if graph and self.graphs is not None:
            out = self.graphs.run(lambda i, p, lay: self._run(i, p, ForwardContext(cache, lay)), cache, input_ids,
                                  positions, layout)
            if out is not None:
                return out if last_row is None else ForwardOutput(out.logits[0, last_row:last_row + 1], out.states)
        return self._run(input_ids.to(self.device), positions.to(self.device), ForwardContext(cache, layout),
                         last_row)

    @torch.inference_mode()
    def verify(
        self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, layout: TreeLayout
    ) -> ForwardOutput:
        """Run tree rows ``input_ids [B, T]`` at ``positions [B, T]`` (T a multiple of ``row_multiple``)."""
        with row_stable():
            return self._pass(cache, input_ids, positions, layout)
