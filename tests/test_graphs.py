"""CUDA graphs of verify passes (:mod:`sot.models.graphs`), checked on the CPU.

The passes run with the GPU's layout (a cache without transposed keys, K/V written through
device-side rows, the attention kernel's inputs) and a reference attention in PyTorch in place
of the Triton kernel; a recorder stands in for a CUDA graph and replays a capture by running
the recorded pass again on the graph's own buffers. So what is checked is what a graph needs
of a pass: it reads its inputs only from those buffers, a replay answers the pass it was given
(not the one captured), shapes get their own graphs, and the outputs are every row's bits of
an eager pass. A real capture on a GPU is checked in ``tests/test_devices.py``."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import sot.attention
from helpers import RandomTreeDrafter, random_prompts, tiny_model
from sot.cache import KVCache
from sot.drafters import NoDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.models.graphs import VerifyGraphs

NEW = 30


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                        ancestors: torch.Tensor, rows: torch.Tensor, scaling: float, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """The Triton kernel's contract in PyTorch, one row at a time (so a row's bits never
    depend on the pass): ``query [B, H, T, D]``, ``keys/values [B, Hkv, S, D]`` ->
    ``[B, T, H, D]`` float32, zero past each sequence's real rows."""
    batch, heads, num_rows, dim = query.shape
    kv_heads = keys.shape[1]
    out = torch.zeros(batch, num_rows, heads, dim)
    for b in range(batch):
        length = int(lengths[b])
        for t in range(int(rows[b])):
            slots = list(range(length)) + [int(a) for a in ancestors[b, t] if a >= 0]
            if window:
                slots = slots[max(0, len(slots) - window):]
            index = torch.tensor(slots)
            k, v = keys[b][:, index].float(), values[b][:, index].float()  # [Hkv, n, D]
            q = query[b, :, t].float().view(kv_heads, heads // kv_heads, dim)
            scores = torch.einsum("kgd,knd->kgn", q, k) * scaling
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[b, t] = torch.einsum("kgn,knd->kgd", torch.softmax(scores, -1), v).reshape(heads, dim)
    return out


class Recorder:
    """Stands in for a CUDA graph: replaying runs the recorded pass again."""

    def __init__(self) -> None:
        self.body = None

    def replay(self) -> None:
        self.body()


class RecordedGraphs(VerifyGraphs):
    def __init__(self, max_graphs: int, fail: bool = False, **limits: int) -> None:
        super().__init__(max_graphs, **limits)
        self.fail = fail
        self.captures = 0
        self.rows: list[int] = []  # every pass's rows

    def run(self, forward, cache, input_ids, positions, layout):
        self.rows.append(input_ids.numel())
        return super().run(forward, cache, input_ids, positions, layout)

    @staticmethod
    def _new_graph() -> Recorder:
        return Recorder()

    def _record(self, graph: Recorder, body) -> None:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        body()  # a capture runs the pass's Python too (on a GPU its kernels are recorded, not run)
        graph.body = body


@pytest.fixture
def gpu_layout(monkeypatch):
    """Passes laid out as on a GPU, with the reference attention as the kernel."""
    monkeypatch.setattr(sot.attention, "use_gpu_kernel", lambda cache: not cache.tiled_keys)
    monkeypatch.setitem(sys.modules, "sot.kernels.triton_attention",
                        SimpleNamespace(tree_attention=reference_attention))


def target_of(model: torch.nn.Module, graphs: VerifyGraphs | None) -> TargetModel:
    target = TargetModel(model)
    target.new_cache = lambda batch, capacity: KVCache(target.num_layers, batch, target.num_kv_heads,
                                                       target.head_dim, capacity)
    target.graphs = graphs
    return target


def run(target: TargetModel, drafter, prompts, batch: int):
    engine = Engine(target, drafter, TreeBudget(16, 6), policy=None, trace=True)
    return engine.generate(prompts, GenerationParams(max_new_tokens=NEW), batch_size=batch)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_replayed_passes_equal_eager_ones(gpu_layout, arch: str) -> None:
    """Speculative decoding through graphs (two kept, fewer than the shapes, so some are dropped)
    gives plain eager decoding's tokens and logits rows, in a batch and alone."""
    model = tiny_model(arch, seed=3)
    prompts = random_prompts((9, 40, 70), seed=4)
    eager = target_of(model, None)
    plain = [run(eager, NoDrafter(), [p], 1)[0] for p in prompts]
    tokens = [r.token_ids for r in plain]
    graphs = RecordedGraphs(max_graphs=2)
    graphed = target_of(model, graphs)
    for batch in (3, 1):
        drafter = RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.7, seed=batch)
        spec = run(graphed, drafter, prompts, batch)
        assert [r.token_ids for r in spec] == tokens
        for a, b in zip(plain, spec):
            assert torch.equal(torch.stack(a.logit_trace)[:NEW], torch.stack(b.logit_trace)[:NEW])
    assert graphs.replays > graphs.captures > 2, (graphs.replays, graphs.captures)
    assert len(graphs.graphs) <= 2
    assert [r.token_ids for r in run(graphed, NoDrafter(), prompts, 3)] == tokens


def test_a_shape_is_captured_on_its_second_pass(gpu_layout) -> None:
    """The first pass of a shape runs eagerly, the second is captured and replayed; the
    outputs are copies, so the next replay leaves them alone."""
    model = tiny_model("llama", seed=1)
    graphs = RecordedGraphs(max_graphs=8)
    target = target_of(model, graphs)
    prompt = random_prompts((12,), seed=2)[0]
    run(target, NoDrafter(), [prompt], 1)
    assert graphs.captures == 1 and graphs.replays == NEW - 2  # the prompt's pass is a prefill
    entry = next(iter(graphs.graphs.values()))
    assert tuple(entry.ids.shape) == (1, target.row_multiple)
    out = VerifyGraphs.run(graphs, lambda *a: None, target.new_cache(1, 64), entry.ids, entry.positions,
                           sot.attention.build_tree_layout([3], [[[0]]], target.row_multiple,
                                                           target.new_cache(1, 64)))
    assert out is None  # another cache: another shape, seen once
    graphs.clear()
    assert not graphs.graphs
    run(target, NoDrafter(), [prompt], 1)
    assert graphs.captures == 2


def test_wide_passes_run_eagerly_and_graph_memory_is_bounded(gpu_layout) -> None:
    """Passes of more rows than ``max_rows`` are never captured; the kept graphs' outputs stay
    within ``max_bytes`` (the least recently used dropped); the answers are unchanged."""
    model = tiny_model("llama", seed=1)
    prompts = random_prompts((12, 30, 50), seed=2)
    tokens = [r.token_ids for r in run(target_of(model, None), NoDrafter(), prompts, 3)]
    budget = 4 * model.config.vocab_size * 4  # the float32 logits of 4 rows
    graphs = RecordedGraphs(max_graphs=8, max_rows=8, max_bytes=budget)
    target = target_of(model, graphs)
    trees = RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.7, seed=4)  # 16-node trees
    for drafter, batch in ((trees, 1), (NoDrafter(), 3), (NoDrafter(), 1)):
        assert [r.token_ids for r in run(target, drafter, prompts, batch)] == tokens
        assert all(entry.ids.numel() <= 8 for entry in graphs.graphs.values())
        assert sum(entry.nbytes for entry in graphs.graphs.values()) <= budget
    assert max(graphs.rows) > 8, "no pass was too wide"
    assert graphs.replays > 0 and graphs.captures >= 2


def test_whole_prompt_chunks_replay_too(gpu_layout) -> None:
    """A prompt's whole chunks (``PREFILL_CHUNK`` rows) replay as graphs: answers, logits rows
    and prompt log probabilities (every chunk row's logits) equal the eager ones."""
    from sot.prefix_cache import PREFILL_CHUNK

    model = tiny_model("llama", seed=5)
    # 3, 2 and 2 whole chunks; the last two end on one, so their first token comes from a replay
    prompts = random_prompts((200, 128, 192), seed=6)

    def answers(target: TargetModel, batch: int, logprobs: int | None):
        params = GenerationParams(max_new_tokens=8, prompt_logprobs=logprobs)
        out = Engine(target, NoDrafter(), TreeBudget(16, 6), policy=None, trace=True).generate(prompts, params,
                                                                                                  batch_size=batch)
        return [(r.token_ids, r.prompt_logprobs, torch.stack(r.logit_trace)) for r in out]

    for logprobs in (None, 2):
        eager = answers(target_of(model, None), 1, logprobs)
        graphs = RecordedGraphs(max_graphs=8)
        target = target_of(model, graphs)
        for batch in (1, 3):
            for (tokens, lp, logits), (e_tokens, e_lp, e_logits) in zip(answers(target, batch, logprobs), eager):
                assert tokens == e_tokens and lp == e_lp and torch.equal(logits, e_logits)
        assert any(tuple(entry.ids.shape) == (1, PREFILL_CHUNK) for entry in graphs.graphs.values())
        assert graphs.replays > 0


def test_a_failed_capture_turns_graphs_off(gpu_layout) -> None:
    model = tiny_model("llama", seed=1)
    prompt = random_prompts((12,), seed=2)[0]
    tokens = run(target_of(model, None), NoDrafter(), [prompt], 1)[0].token_ids
    graphs = RecordedGraphs(max_graphs=8, fail=True)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off for this model"):
        out = run(target_of(model, graphs), NoDrafter(), [prompt], 1)
    assert out[0].token_ids == tokens
    assert "not permitted" in graphs.failed and graphs.replays == 0 and not graphs.graphs


@pytest.mark.parametrize("batch", [1, 3])
def test_device_side_writes_equal_slot_writes(batch: int) -> None:
    """``KVCache.write`` through :meth:`KVCache.write_rows` puts every row where the host
    slots do."""
    gen = torch.Generator().manual_seed(0)
    caches = [KVCache(2, 4, 2, 8, 64) for _ in range(2)]
    slots = torch.tensor([[5 + 7 * b + t for t in range(6)] for b in range(batch)])
    keys, values = torch.randn(batch, 2, 6, 8, generator=gen), torch.randn(batch, 2, 6, 8, generator=gen)
    caches[0].narrow(batch).write(1, slots, keys, values)
    view = caches[1].narrow(batch)
    view.write(1, slots, keys, values, view.write_rows(slots))
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    assert caches[1].keys[1, :batch].abs().sum() > 0
    assert KVCache(1, 1, 2, 8, 64).write_rows(torch.tensor([[5, 6]])).tolist() == [5, 6, 69, 70]
