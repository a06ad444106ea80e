"""CUDA graphs of verify passes.

On a GPU a small model's verify pass is bound by launching its kernels from Python: the default
model's 30 layers cost about 12 ms a pass on an H200 whether the pass computes 1 row or 16
(``docs/gpu.md``). A CUDA graph records a pass's kernels once and replays them in one launch.

A graph fixes the address and shape of every tensor it touches, so SoT keeps one graph per
pass shape: the token grid ``[B, T]``, the width of the attention kernel's ancestor table and
the cache the pass runs against. The inputs that change from pass to pass (token ids,
positions, the K/V write rows, and the kernel's lengths, ancestor table and real rows) are
copied into the graph's own buffers before each replay; what else a pass reads (the weights,
the cache) stays where the graph saw it. So a model's parameters may change in place, but a
parameter replaced by another tensor needs :meth:`VerifyGraphs.clear` first. A replay runs the kernels of the eager pass on the
same shapes, so every row keeps its bits (``tests/test_devices.py`` checks that on a GPU).

The prompt's whole chunks (``PREFILL_CHUNK`` rows, :meth:`TargetModel.prefill`) go through
the same graphs: a graph computes every row's logits, and the caller keeps the last row's.

A shape is captured the second time it is seen: its first pass runs eagerly, which also
compiles the Triton kernel for it. At most :data:`MAX_GRAPHS` are kept, whose outputs take at
most :data:`MAX_GRAPH_BYTES`, the least recently used dropped first; a pass of more than
:data:`MAX_GRAPH_ROWS` rows runs eagerly (its kernels are long enough that launching them
costs little, and its logits alone would hold much memory: 128 rows of a 256k vocabulary
are 64 MiB in bfloat16). ``SOT_NO_CUDA_GRAPHS=1`` turns graphs off, and a capture that fails
turns them off for the model with a warning (every pass then runs eagerly, as before).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from sot.attention import KernelInputs, TreeLayout

if TYPE_CHECKING:
    from sot.cache import KVCache

#: graphs kept per model (each holds its own activations; a 30-layer, width-576 model's
#: 8 x 16-row pass needs a few tens of MB)
MAX_GRAPHS = 48
#: the most rows (sequences x rows each) a graphed pass has
MAX_GRAPH_ROWS = 256
#: the most bytes the kept graphs' outputs (logits, states) take together
MAX_GRAPH_BYTES = 2 << 30


@dataclass
class _Graph:
    """One captured pass: the graph, its input buffers and its outputs."""

    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64
    write_rows: torch.Tensor  # [B * Hkv * T] int64
    kernel: KernelInputs  # lengths [B], ancestors [B, T, W], rows [B] (int32)
    out: Any  # the ForwardOutput the capture produced (its tensors live in the graph's pool)

    @property
    def nbytes(self) -> int:
        """Bytes of the graph's outputs."""
        tensors = [self.out.logits] + ([] if self.out.states is None else [self.out.states])
        return sum(t.numel() * t.element_size() for t in tensors)


class VerifyGraphs:
    """The CUDA graphs of one target model's verify passes.

    Args:
        max_graphs: graphs kept at once (least recently used dropped first).
        max_rows: passes of more rows run eagerly.
        max_bytes: the kept graphs' outputs take at most this many bytes.
    """

    def __init__(self, max_graphs: int = MAX_GRAPHS, max_rows: int = MAX_GRAPH_ROWS,
                 max_bytes: int = MAX_GRAPH_BYTES) -> None:
        self.max_graphs, self.max_rows, self.max_bytes = max_graphs, max_rows, max_bytes
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self._pool = None
        #: why capturing was given up (graphs are then off for this model), or ``None``
        self.failed: str | None = None
        #: passes answered by a replay
        self.replays = 0

    def clear(self) -> None:
        """Forget every graph (after a model's parameters were replaced by other tensors)."""
        self.graphs.clear()
        self._seen.clear()

    @staticmethod
    def _key(cache, ids: torch.Tensor, layout: TreeLayout) -> tuple:
        keys, values = cache.keys, cache.values
        return (tuple(ids.shape), tuple(layout.kernel.ancestors.shape), keys.data_ptr(), values.data_ptr(),
                tuple(keys.shape), tuple(keys.stride()), keys.dtype)

    def run(self, forward: Callable[[torch.Tensor, torch.Tensor, TreeLayout], Any], cache: KVCache,
            input_ids: torch.Tensor,
            positions: torch.Tensor, layout: TreeLayout) -> Any | None:
        """The pass ``forward(ids, positions, layout)`` from a graph: ``input_ids`` and
        ``positions`` ``[B, T]`` (host or device), ``layout`` built for ``cache`` on the GPU.

        Returns the ForwardOutput (copies of the graph's outputs, so a later replay leaves
        them alone), or ``None`` where the pass should run eagerly: a shape's first pass, a
        layout without the GPU kernel's inputs, or graphs turned off."""
        if (self.failed is not None or layout.kernel is None or layout.write_rows is None
                or input_ids.numel() > self.max_rows):
            return None
        key = self._key(cache, input_ids, layout)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self._seen:
                if len(self._seen) >= 8 * self.max_graphs:
                    self._seen.clear()
                self._seen.add(key)
                return None
            entry = self._capture(forward, input_ids, positions, layout)
            if entry is None:
                return None
            self.graphs[key] = entry
            while len(self.graphs) > 1 and (len(self.graphs) > self.max_graphs
                                            or sum(e.nbytes for e in self.graphs.values()) > self.max_bytes):
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        self._load(entry, input_ids, positions, layout)
        entry.graph.replay()
        self.replays += 1
        out = entry.out
        return type(out)(out.logits.clone(), None if out.states is None else out.states.clone(), out.offsets)

    @staticmethod
    def _load(entry: _Graph, input_ids: torch.Tensor, positions: torch.Tensor, layout: TreeLayout) -> None:
        """Copy one pass's inputs into the graph's buffers."""
        k = layout.kernel
        entry.ids.copy_(input_ids)
        entry.positions.copy_(positions)
        entry.write_rows.copy_(layout.write_rows)
        entry.kernel.lengths.copy_(k.lengths)
        entry.kernel.ancestors.copy_(k.ancestors)
        entry.kernel.rows.copy_(k.rows)

    def _capture(self, forward: Callable[[torch.Tensor, torch.Tensor, TreeLayout], Any], input_ids: torch.Tensor,
                 positions: torch.Tensor, layout: TreeLayout) -> _Graph | None:
        device = layout.write_rows.device
        k = layout.kernel
        entry = _Graph(
            graph=self._new_graph(),
            ids=input_ids.to(device, copy=True),
            positions=positions.to(device, copy=True),
            write_rows=layout.write_rows.clone(),
            kernel=KernelInputs(k.lengths.clone(), k.ancestors.clone(), k.rows.clone()),
            out=None,
        )
        static = TreeLayout(write_slots=layout.write_slots, kernel=entry.kernel, write_rows=entry.write_rows)

        def body() -> None:
            entry.out = forward(entry.ids, entry.positions, static)

        try:
            self._record(entry.graph, body)
        except Exception as exc:  # noqa: BLE001 - any failure: run eagerly from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            warnings.warn(f"CUDA graphs are off for this model: capturing a verify pass failed ({self.failed}); "
                          "every pass runs eagerly", RuntimeWarning, stacklevel=3)
            return None
        return entry

    @staticmethod
    def _new_graph() -> Any:
        return torch.cuda.CUDAGraph()

    def _record(self, graph: Any, body: Callable[[], None]) -> None:
        """Capture ``body`` (one pass on the graph's buffers) into ``graph``; nothing runs."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's CUDA work (a test-time learner) does not break the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            body()
