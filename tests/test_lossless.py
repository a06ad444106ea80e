"""The test that must never be missing: speculative output equals plain output, token for
token, across architectures, drafters, batch sizes and dtypes."""
from __future__ import annotations

import pytest
import torch

from helpers import (ARCHS, VOCAB, RandomTreeDrafter, blockify, blocks_reference, clone, hf_greedy, random_blocks,
                     random_prompts, tiny_model, trained_norms)
from sot.drafters import LookupDrafter, NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.kernels import cpu_kernels
from sot.models.adapter import TargetModel
from sot.models.loading import INT8_ATTR

NEW = 40
LENGTHS = (7, 30, 75)  # different prompt lengths in one batch
PARAMS = GenerationParams(max_new_tokens=NEW)


def run(target: TargetModel, drafter, prompts, budget=TreeBudget(16, 6)) -> list[list[int]]:
    return [r.token_ids for r in Engine(target, drafter, budget).generate(prompts, PARAMS)]


def traced(target: TargetModel, drafter, prompts, budget=TreeBudget(16, 6)) -> list[torch.Tensor]:
    """Per sequence, the ``[N, V]`` logits rows that decided each committed token."""
    results = Engine(target, drafter, budget, trace=True).generate(prompts, PARAMS)
    return [torch.stack(r.logit_trace)[: r.new_tokens] for r in results]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_equals_plain(arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    target = TargetModel(clone(model, dtype))

    plain_batch = run(target, NoDrafter(), prompts)
    plain_alone = [run(target, NoDrafter(), [p])[0] for p in prompts]
    assert plain_batch == plain_alone, "a sequence's output changed with its batch"

    pld_batch = run(target, PromptLookupDrafter(), prompts)
    assert pld_batch == plain_batch
    # the shipped pld drafter: no model, so its chains go through the free drafts' path
    assert run(target, LookupDrafter(), prompts) == plain_batch
    assert [run(target, LookupDrafter(), [p])[0] for p in prompts] == plain_batch
    rnd = RandomTreeDrafter(plain_batch, [len(p) for p in prompts], hit=0.7, seed=3)
    rnd_batch = run(target, rnd, prompts)
    assert rnd_batch == plain_batch
    rnd_alone = [
        run(target, RandomTreeDrafter([plain_batch[i]], [len(p)], hit=0.7, seed=i), [p])[0]
        for i, p in enumerate(prompts)
    ]
    assert rnd_alone == plain_batch

    if dtype == torch.float32:
        reference = [hf_greedy(model, p, NEW) for p in prompts]
        assert plain_batch == reference, "plain decoding differs from transformers generate()"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "gemma2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_are_bit_identical(arch: str, dtype: torch.dtype) -> None:
    """Stronger than token equality: every logits row behind a committed token is the same
    bits in a speculative batch as in plain decoding alone."""
    model = tiny_model(arch, seed=11)
    prompts = random_prompts(LENGTHS, seed=5)
    target = TargetModel(clone(model, dtype))
    plain = [traced(target, NoDrafter(), [p])[0] for p in prompts]
    tokens = [t.argmax(-1).tolist() for t in plain]
    drafter = RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.8, seed=9)
    spec = traced(target, drafter, prompts)
    for a, b in zip(plain, spec):
        assert a.shape == b.shape
        assert torch.equal(a, b)


def test_random_drafter_really_rejects_and_accepts_side_branches() -> None:
    """Guard the guard: the random drafter must exercise rejections and non-first branches."""
    model = tiny_model("llama")
    prompts = random_prompts((20,), seed=2)
    target = TargetModel(clone(model, torch.float32))
    plain = run(target, NoDrafter(), prompts)
    drafter = RandomTreeDrafter(plain, [20], hit=0.7, seed=5)
    engine = Engine(target, drafter, TreeBudget(16, 6))
    res = engine.generate(prompts, PARAMS)[0]
    assert res.token_ids == plain[0]
    assert 1.0 < res.mean_accept_len < 7.0
    assert min(res.accept_lengths) == 1  # some steps rejected everything


def test_deep_and_wide_trees_stay_lossless() -> None:
    """Trees larger than one 16-row block and deeper than the tail alignment."""
    model = tiny_model("qwen2")
    prompts = random_prompts((12, 50), seed=4)
    target = TargetModel(clone(model, torch.bfloat16))
    plain = run(target, NoDrafter(), prompts)
    drafter = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.9, seed=7)
    assert run(target, drafter, prompts, TreeBudget(40, 36)) == plain


def test_fast_path_matches_generic_path_bit_for_bit() -> None:
    """SoT's lean forward gives the logits of the transformers modules (with SoT's norms and
    attention plugged in), bit for bit: prompt rows and tree rows, float32 and bfloat16, Qwen3's
    query/key norms and sliding layer, and Gemma 3 in float32 with its (1 + w) norms, query/key norms and per-layer rotary tables (its
    norm weights made non-zero, as trained ones are)."""
    from sot.attention import build_tree_layout

    for arch in ("llama", "qwen2", "qwen3", "mistral", "gemma3"):
        for dtype in (torch.float32,) if arch == "gemma3" else (torch.float32, torch.bfloat16):
            model = tiny_model(arch)
            if arch == "gemma3":
                trained_norms(model)
            logits = []
            for fast in (False, True):
                target = TargetModel(clone(model, dtype), fast=fast)
                assert (target.fast is not None) == fast
                cache = target.new_cache(1, 256)
                prompt = torch.tensor(random_prompts((37,))[0])
                pre = target.prefill(cache, 0, prompt)
                cache.set_length(0, 37)
                layout = build_tree_layout([37], [[[0, -1], [0, 1], [0, 2]]], 16, cache)
                ids = torch.tensor([[5, 6, 7] + [5] * 13])
                pos = torch.tensor([[37, 38, 38] + [37] * 13])
                logits.append((pre.logits, target.verify(cache, ids, pos, layout).logits[:, :3]))
            assert torch.equal(logits[0][0], logits[1][0]), (arch, dtype)
            assert torch.equal(logits[0][1], logits[1][1]), (arch, dtype)


@pytest.mark.parametrize("arch,products,dtype", [
    ("llama", "panels", torch.float32), ("llama", "blocks", torch.float32), ("llama", "int8", torch.float32),
    ("qwen2", "panels", torch.float32),
    ("mistral", "blocks", torch.float32), ("llama", "onednn", torch.float32), ("llama", "onednn-short", torch.float32),
    ("llama", "onednn", torch.bfloat16),
    ("mistral", "onednn", torch.bfloat16),
    ("llama", "bf16blocks", torch.bfloat16), ("mistral", "bf16blocks", torch.bfloat16),
    ("gemma3", "panels", torch.float32), ("gemma3", "blocks", torch.float32), ("gemma3", "int8", torch.float32),
    ("qwen3", "blocks", torch.float32), ("llama", "panels16", torch.float32),
])
def test_compiled_layer_loop_equals_the_python_loop_bit_for_bit(arch: str, products: str, dtype: torch.dtype,
                                                                 monkeypatch) -> None:
    """The decoder layers in one compiled call give the same logits and states, bit for bit,
    as the Python loop over the same kernels: padded and flat-packed passes of two sequences,
    a sliding window (Mistral, Qwen3 and Gemma 3), a bias (Qwen2), query/key norms (Qwen3,
    Gemma 3), Gemma 3's other norms, GELU and two rotary tables; float32 on SoT's panels and 4-bit blocks, and
    on oneDNN's packed products (as bfloat16 runs where oneDNN packs it: CPUs with AVX-512),
    also where short blocks must be padded to whole ones ("onednn-short"); and the 8-bit integer
    products of ``--dtype int8`` over the blocks."""
    import sot.kernels.linear
    import sot.models.fast_llama
    from sot.tree import tree_from_paths
    from sot.packing import pack_trees

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    if products.startswith("onednn") and dtype == torch.float32:  # products on oneDNN, the rest on SoT's kernels
        monkeypatch.setattr(sot.kernels.linear, "cpu_kernels", lambda: None)
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
        monkeypatch.setattr(sot.models.fast_llama, "fused_rms_norm", lambda dtype, device: kernels.rms_norm_f32)
    if products == "onednn-short":
        monkeypatch.setattr(sot.kernels.linear.PackedLinear, "_probe_partial_blocks", lambda self: False)
    if products == "bf16blocks":
        _needs_bf16_blocks()
    blocks = products in ("blocks", "int8", "bf16blocks")

    model = tiny_model(arch, seed=5, **({"sliding_window": 24} if arch == "mistral" else {}))
    if arch == "gemma3":
        trained_norms(model)
    if products == "panels16":  # (a bfloat16 checkpoint loaded in float32)
        model = clone(model, torch.bfloat16).float()
    if blocks:
        model = blockify(model)
    runs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setenv("SOT_NO_LAYER_CALL", "1")
        if products == "bf16blocks":
            from sot.kernels.linear import cast_keeping_blocks

            copy = clone(model, torch.float32)
            cast_keeping_blocks(copy, dtype)
        else:
            copy = clone(model, dtype)
        setattr(copy, INT8_ATTR, products == "int8")
        target = TargetModel(copy, state_layers=(0, 1, 2))
        monkeypatch.delenv("SOT_NO_LAYER_CALL", raising=False)
        linears = [lin for lay in target.fast.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        if dtype == torch.bfloat16 and any(lin.kind != "mkldnn" for lin in linears):
            pytest.skip("oneDNN does not pack bfloat16 weights on this CPU, so its passes stay in Python")
        assert all(lin.kind == ("mkldnn" if products.startswith("onednn") else "sot") for lin in linears)
        assert all(lin.bf16_blocks == (products == "bf16blocks") for lin in linears)
        if products == "onednn-short":
            assert not any(lin.partial_ok for lin in linears)
        assert (target.fast.layer_call is not None) == compiled
        assert all(isinstance(lin.packed, tuple) == blocks for lin in linears)
        assert all(lin.storage[0] == "16-bit panels" for lin in linears) == (products == "panels16")
        assert all(lin.int8 == (products == "int8") for lin in linears)
        prompts = random_prompts((37, 29), seed=8)
        outs = []
        for flat in (False, True):
            cache = target.new_cache(2, 128)
            for b, prompt in enumerate(prompts):
                target.prefill(cache, b, torch.tensor(prompt))
                cache.set_length(b, len(prompt))
            trees = [tree_from_paths(5, [[6, 7, 8], [9]], max_nodes=8), tree_from_paths(3, [[4]], max_nodes=8)]
            monkeypatch.setattr(type(target), "packs_flat", lambda self, c, flat=flat: flat)
            batch = pack_trees(trees, cache, target)
            assert (batch.layout.flat_index is not None) == flat
            out = target.verify(cache, batch.ids, batch.positions, batch.layout)
            outs.append((out.logits, out.states))
        runs.append(outs)
    for (logits_c, states_c), (logits_p, states_p) in zip(*runs):
        assert torch.equal(logits_c, logits_p)
        assert torch.equal(states_c, states_p)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "mistral"])
def test_pytorch_attention_path_is_lossless(arch: str, monkeypatch) -> None:
    """Without the compiled kernel (no compiler, or another device) the PyTorch attention
    path must be exact on its own terms too."""
    import sot.attention
    import sot.models.adapter
    import sot.kernels.linear
    import sot.models.fast_llama

    for module in (sot.attention, sot.models.adapter, sot.models.fast_llama, sot.kernels.linear):
        monkeypatch.setattr(module, "cpu_kernels", lambda: None)
    model = tiny_model(arch, seed=21)
    prompts = random_prompts(LENGTHS, seed=6)
    target = TargetModel(clone(model, torch.bfloat16))
    assert not target.new_cache(1, 64).tiled_keys
    plain = [traced(target, NoDrafter(), [p])[0] for p in prompts]
    tokens = [t.argmax(-1).tolist() for t in plain]
    spec = traced(target, RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.8, seed=2), prompts)
    for a, b in zip(plain, spec):
        assert torch.equal(a, b)


def test_head_dim_outside_the_kernel_uses_the_pytorch_path() -> None:
    """A head size the compiled kernel does not take (8) must still decode exactly."""
    import transformers

    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    target = TargetModel(clone(model, torch.bfloat16))
    assert not target.new_cache(1, 64).tiled_keys
    prompts = random_prompts((9, 40), seed=3)
    plain = run(target, NoDrafter(), prompts)
    assert run(target, RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8), prompts) == plain


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_a_smaller_kv_cache_keeps_speculation_exact(arch: str, kv: str) -> None:
    """A float32 model over a float16 or bfloat16 KV cache (``kv_cache_dtype``; the fast path,
    a sliding window and the generic path): tree rows give plain decoding's logits bit for bit,
    alone and in a batch, and the answers are close to the float32 cache's, not always equal."""
    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    model = tiny_model(arch)
    target = TargetModel(clone(model, torch.float32), kv_cache_dtype=kv)
    assert target.new_cache(1, 64).keys.dtype == getattr(torch, kv)
    prompts = random_prompts(LENGTHS, seed=2)
    plain = traced(target, NoDrafter(), prompts)
    tokens = [t.argmax(-1).tolist() for t in plain]
    assert [t.argmax(-1).tolist() for t in traced(target, NoDrafter(), prompts[:1])] == tokens[:1]
    spec = traced(target, RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.7, seed=5), prompts)
    for a, b in zip(plain, spec):
        assert torch.equal(a, b)
    wide = traced(TargetModel(clone(model, torch.float32)), NoDrafter(), prompts)
    first = [a[0] for a in plain], [b[0] for b in wide]  # the first token's logits: only the rounding apart
    assert all(torch.allclose(a, b, atol=0.05) and not torch.equal(a, b) for a, b in zip(*first))


def test_kv_cache_dtypes_a_model_cannot_take_are_refused_by_name() -> None:
    from sot.errors import ConfigError

    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="float16 takes a float32 engine"):
        TargetModel(clone(model, torch.bfloat16), kv_cache_dtype="float16")
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        TargetModel(clone(model, torch.float32), kv_cache_dtype="fp8")
    assert TargetModel(clone(model, torch.bfloat16), kv_cache_dtype="float32").kv_dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (5, 1)], ids=["group3", "group5"])
def test_kernel_query_head_groups_are_lossless(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """The compiled attention has register-resident code for 1-4 query heads per KV head
    and a generic loop beyond; both must keep tree rows identical to plain decoding (the
    tiny models of the matrix cover groups 1, 2 and 4)."""
    import transformers

    torch.manual_seed(4)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=16 * heads, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    target = TargetModel(clone(model, dtype))
    assert target.new_cache(1, 64).tiled_keys == (cpu_kernels() is not None)
    prompts = random_prompts((9, 40), seed=4)
    plain = traced(target, NoDrafter(), prompts)
    tokens = [t.argmax(-1).tolist() for t in plain]
    spec = traced(target, RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.8, seed=3), prompts)
    for a, b in zip(plain, spec):
        assert torch.equal(a, b)


def test_packed_linear_prefers_a_row_stable_kernel() -> None:
    """Float32 products take a kernel whose short blocks give each row the bits of a full
    block whenever the machine has one (SoT's compiled kernel, MKL or oneDNN), so one-row
    passes need no padding; with or without one, a row's result never depends on the other
    rows."""
    from sot.kernels import cpu_kernels
    from sot.kernels.linear import PackedLinear, pack_panels
    from sot.models.rows import ROW_UNIT

    gen = torch.Generator().manual_seed(3)
    for n, k in ((96, 64), (3072, 576), (576, 1536)):
        w = torch.randn(n, k, generator=gen) / k**0.5
        x = torch.randn(ROW_UNIT, k, generator=gen)

        def stable(block) -> bool:
            return all(torch.equal(block(x[:m]), block(x)[:m]) for m in (1, 3, 8))

        kernels = []
        compiled = cpu_kernels()
        if compiled is not None:
            panels = pack_panels(w)
            kernels.append(lambda a, p=panels: compiled.linear_f32(a, p, w.shape[0], None))
        if torch.backends.mkl.is_available():
            mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, ROW_UNIT)
            kernels.append(lambda a, p=mkl: torch.ops.mkl._mkl_linear(a, p, w, None, ROW_UNIT))
        if torch.backends.mkldnn.is_available():
            dnn = torch.ops.mkldnn._reorder_linear_weight(w, ROW_UNIT)
            kernels.append(lambda a, p=dnn: torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], ""))
        lin = PackedLinear(w)
        assert lin.partial_ok == any(stable(f) for f in kernels), (n, k, lin.kind)
        full = lin(x, stable=True)
        for m in (1, 5, ROW_UNIT + 3):
            rows = torch.cat([x, x])[:m]
            assert torch.equal(lin(rows, stable=True)[: min(m, ROW_UNIT)], full[: min(m, ROW_UNIT)])
        torch.testing.assert_close(full, x @ w.T, rtol=1e-4, atol=1e-4)


def test_compiled_float32_linear_is_row_stable() -> None:
    """SoT's float32 kernel: any row count, any place of a row in the call, ragged column
    counts and a bias give each row the same bits, and the values are the product's."""
    from sot.kernels import cpu_kernels
    from sot.kernels.linear import pack_panels

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the compiled kernel is unavailable here")
    gen = torch.Generator().manual_seed(5)
    for n, k in ((100, 40), (48, 576), (33, 7)):
        w = torch.randn(n, k, generator=gen) / k**0.5
        bias = torch.randn(n, generator=gen)
        x = torch.randn(37, k, generator=gen)
        panels = pack_panels(w)
        assert panels.shape == (-(-n // 16), k, 16)
        full = kernel.linear_f32(x, panels, n, bias)
        torch.testing.assert_close(full, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
        for lo, hi in ((0, 1), (5, 6), (3, 5), (2, 9), (0, 16), (20, 37)):
            assert torch.equal(kernel.linear_f32(x[lo:hi], panels, n, bias), full[lo:hi]), (n, k, lo, hi)
        with pytest.raises(RuntimeError, match="packed weight mismatch"):
            kernel.linear_f32(x[:, :-1], panels, n, bias)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_weights_of_16_bit_values_keep_16_bit_panels_and_the_float32_bits(narrow: torch.dtype) -> None:
    """A float32 weight whose values are all bfloat16 (or float16) values, as a 16-bit
    checkpoint's are once loaded in float32, is packed in 16-bit panels: half the bytes, and
    every row count's products equal the float32 panels' bit for bit (each weight converted
    exactly, the same chains of multiply-adds). One value that is not such a value keeps float32
    panels, as does ``compress=False``."""
    from sot.kernels import cpu_kernels
    from sot.kernels.linear import PackedLinear, pack_panels

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the compiled kernel is unavailable here")
    gen = torch.Generator().manual_seed(6)
    for n, k in ((100, 40), (48, 576), (33, 7)):
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(narrow).float()
        bias = torch.randn(n, generator=gen)
        lin = PackedLinear(w, bias)
        assert lin.packed.dtype == narrow and lin.storage == ("16-bit panels", lin.packed.nbytes)
        assert lin.packed.nbytes * 2 == pack_panels(w).nbytes
        x = torch.randn(23, k, generator=gen)
        for rows in (1, 2, 3, 6, 7, 16, 23):
            assert torch.equal(lin(x[:rows], True), kernel.linear_f32(x[:rows], pack_panels(w), n, bias)), (n, k)
        assert PackedLinear(w, bias, compress=False).packed.dtype == torch.float32
        odd = w.clone()
        odd[n // 2, k // 2] = float(odd[n // 2, k // 2]) + 2.0 ** -20  # (now no 16-bit value)
        assert PackedLinear(odd, bias).storage[0] == "float32 panels"


def test_compiled_float32_rms_norm_is_row_stable() -> None:
    """The fused float32 RMSNorm: the residual sum is the plain sum, the values are the
    formula's (to float32 rounding), and a row's bits do not depend on its neighbours."""
    from sot.kernels.linear import fused_rms_norm

    norm = fused_rms_norm(torch.float32, torch.device("cpu"))
    if norm is None:
        pytest.skip("the compiled kernel is unavailable here")
    gen = torch.Generator().manual_seed(3)
    for d in (576, 37):
        w = torch.randn(d, generator=gen)
        x = torch.randn(2, 9, d, generator=gen)
        res = torch.randn(2, 9, d, generator=gen)
        out, total = norm(x, w, 1e-5, res)
        assert torch.equal(total, x + res)
        torch.testing.assert_close(out, w * torch.nn.functional.rms_norm(x + res, (d,), eps=1e-5), rtol=1e-5, atol=1e-6)
        alone = norm(x, w, 1e-5, None)
        assert len(alone) == 1
        flat, flat_res = x.reshape(18, d), res.reshape(18, d)
        for lo, hi in ((0, 1), (4, 5), (3, 11), (17, 18)):
            assert torch.equal(norm(flat[lo:hi], w, 1e-5, flat_res[lo:hi])[0], out.reshape(18, d)[lo:hi])
    with pytest.raises(RuntimeError, match="weight size mismatch"):
        norm(x, w[:-1], 1e-5, None)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "l1-block"])
def test_weights_stored_as_exact_blocks_are_multiplied_block_by_block(fused: bool, monkeypatch) -> None:
    """Float32 weights that are exactly GGUF Q4_1 or Q8_0 blocks (as in a model dequantized
    from a GGUF file) are kept in 4 or 8 bits and multiplied as the format factors them
    (``d * sum(x * q) + m * sum(x)`` per block: in registers for 1-6 rows, 32 inputs at a time
    from an L1 block for more, or always from the L1 block with the fused paths off). Every
    row has the bits of that formula taken one operation at a time, for any rows, and the
    product is the float32 product's up to rounding. Other weights are refused."""
    from sot.kernels import cpu_kernels
    from sot.kernels.linear import PackedLinear, pack_blocks, pack_panels

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the compiled kernel is unavailable here")
    monkeypatch.setenv("SOT_NO_FUSED_BLOCKS", "0" if fused else "1")  # for PackedLinear below
    gen = torch.Generator().manual_seed(8)
    n, k = 100, 96
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q4 = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q4[..., 0], q4[..., 1] = 0, 15  # a block's minimum is its offset, as the quantizer makes it
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q8[..., 0] = 127
    x = torch.randn(21, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for q, mins, dtype in ((q4, low, torch.uint8), (q8, None, torch.int8)):
        w = (scale * q + (0 if mins is None else mins)).reshape(n, k)
        blocks = pack_blocks(w)
        assert blocks is not None and blocks[0].dtype == dtype and blocks[1].dtype == torch.float16
        full = blocks_reference(x, q, scale, mins, bias)
        assert torch.equal(kernel.linear_blocks_f32(x, *blocks, n, bias, fused), full)
        torch.testing.assert_close(full, kernel.linear_f32(x, pack_panels(w), n, bias), rtol=1e-5, atol=1e-5)
        slices = ((0, 1), (4, 6), (3, 6), (5, 9), (1, 6), (0, 6), (2, 9), (0, 8), (1, 11), (0, 12), (4, 17), (0, 20))
        for lo, hi in slices:
            assert torch.equal(kernel.linear_blocks_f32(x[lo:hi], *blocks, n, bias, fused), full[lo:hi])
        assert kernel.linear_blocks_f32(x[:0], *blocks, n, bias, fused).shape == (0, n)
        lin = PackedLinear(w, bias)
        assert isinstance(lin.packed, tuple) and lin.fused is fused
        assert torch.equal(lin(x[:3], stable=True), full[:3])
    nearly = (scale * q4 + low).reshape(n, k).clone()
    nearly[5, 7] = torch.nextafter(nearly[5, 7], torch.tensor(1.0))
    assert pack_blocks(nearly) is None and pack_blocks(torch.randn(n, k, generator=gen)) is None
    assert not isinstance(PackedLinear(nearly).packed, tuple)


def _needs_bf16_blocks() -> None:
    from sot.kernels.linear import bf16_blocks_supported

    if not bf16_blocks_supported():
        pytest.skip("the bfloat16 block kernel needs a CPU with AVX512-BF16 (and the compiled kernels); "
                    "this one has none")


@pytest.fixture(params=["avx512bf16", "amx"])
def bf16_chain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each chain the bfloat16 block products can take on this machine: AVX512-BF16's pair dot
    products, and AMX tiles where the CPU has them (skipped, with the reason, where not). The
    chain is one switch for the process, set as a model's products are packed; it is put back
    after the test."""
    _needs_bf16_blocks()
    from sot.kernels.linear import amx_products

    kernel = cpu_kernels()
    if request.param == "amx" and not kernel.amx_supported():
        pytest.skip("the AMX chain needs a CPU with AMX tiles (AMX-BF16), Linux 5.16 or later and a compiler that "
                    "knows the tiles (GCC 11, Clang 12); this machine lacks one of them")
    before = kernel.amx_products()
    if request.param == "amx":
        monkeypatch.delenv("SOT_NO_AMX", raising=False)
    else:
        monkeypatch.setenv("SOT_NO_AMX", "1")
    assert amx_products() == (request.param == "amx")
    yield request.param
    kernel.set_amx_products(before)


def _sums_offset(kernel, one: torch.Tensor, blocks, n: int) -> torch.Tensor:
    """A one-row call's bfloat16 output plus what rounding left of it, ``[n]`` float32: the
    row's float32 sums to 16 bits, to read the rest against (:func:`_sums_alone_and_together`)."""
    first = kernel.linear_blocks_bf16(one, *blocks, n, None).float()[0]
    return first + kernel.linear_blocks_bf16(one, *blocks, n, -first).float()[0]


def _sums_alone_and_together(kernel, x: torch.Tensor, blocks, n: int, i: int, lo: int, hi: int,
                             offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The low bits of row ``i``'s float32 sums ``[n]`` (``bf16(s - c)``, read through the
    bias, ``c`` = ``offset`` or the row's own :func:`_sums_offset`), the row alone and in a
    call over rows ``lo..hi-1``: bfloat16 outputs hide most differences of the sums."""
    one = x[i:i + 1]
    offset = _sums_offset(kernel, one, blocks, n) if offset is None else offset
    alone = kernel.linear_blocks_bf16(one, *blocks, n, -offset)[0]
    together = kernel.linear_blocks_bf16(x[lo:hi], *blocks, n, -offset)[i - lo]
    return alone, together


def test_bf16_block_products_are_row_stable_and_use_the_bf16_weights(bf16_chain: str) -> None:
    """``linear_blocks_bf16`` over Q4_1 and Q8_0 blocks, on each chain: each row's bits are the
    same whatever else shares the call (AVX512-BF16: 1-8 rows in registers, more through L1
    blocks; AMX: groups of 16 rows in tiles, 64 a sweep); its weights are ``weight.to(bfloat16)``
    exactly; stacked parameters read their parts' blocks; a weight changed in place since its
    blocks were found is no longer read from them."""
    from sot.kernels.linear import PackedLinear, cast_keeping_blocks, pack_blocks_bf16

    kernel = cpu_kernels()
    gen = torch.Generator().manual_seed(4)
    n, k = 80, 96
    scale, low, q4, q8 = random_blocks(n, k, gen)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    for w, dtype in (((scale * q4 + low).reshape(n, k), torch.uint8), ((scale * q8).reshape(n, k), torch.int8)):
        blocks = pack_blocks_bf16(w)
        assert blocks is not None and blocks[0].dtype == dtype
        full = kernel.linear_blocks_bf16(x, *blocks, n, bias)
        for lo, hi in ((0, 1), (4, 6), (3, 7), (5, 13), (0, 8), (1, 10), (0, 16), (4, 21), (20, 21), (3, 20),
                       (10, 45), (0, 64), (5, 70), (69, 70)):
            assert torch.equal(kernel.linear_blocks_bf16(x[lo:hi], *blocks, n, bias), full[lo:hi]), (lo, hi)
            # (the float32 sums too, which bfloat16 outputs mostly hide)
            for i in sorted({lo, (lo + hi) // 2, hi - 1}):
                alone, together = _sums_alone_and_together(kernel, x, blocks, n, i, lo, hi)
                assert torch.equal(alone, together), (lo, hi, i)
        rows = torch.eye(k).to(torch.bfloat16)  # one product per output: the weight itself
        assert torch.equal(kernel.linear_blocks_bf16(rows, *blocks, n, None), w.to(torch.bfloat16).T)
        near = (x.float() @ w.to(torch.bfloat16).float().T + bias).to(torch.bfloat16)
        assert (full.float() - near.float()).abs().max() <= 0.02 * near.float().abs().max()
        if bf16_chain == "amx":  # (the tiles really multiply: the other chain's sums differ)
            offsets = [_sums_offset(kernel, x[i:i + 1], blocks, n) for i in range(0, 70, 7)]
            tiles = [_sums_alone_and_together(kernel, x, blocks, n, 7 * j, 0, 70, c)[0] for j, c in enumerate(offsets)]
            kernel.set_amx_products(False)
            pairs = [_sums_alone_and_together(kernel, x, blocks, n, 7 * j, 0, 70, c)[0] for j, c in enumerate(offsets)]
            kernel.set_amx_products(True)
            assert not all(torch.equal(a, b) for a, b in zip(tiles, pairs))
    # parameters stacked along their outputs (q, k, v) read their own blocks, cast from float32
    parts = [torch.nn.Linear(k, m, bias=False) for m in (32, 16, 40)]
    for lin, m in zip(parts, (32, 16, 40)):
        lin.weight.data = (scale[:m] * q4[:m] + low[:m]).reshape(m, k)
    whole = torch.cat([lin.weight.data for lin in parts])
    module = torch.nn.Sequential(*parts)
    assert cast_keeping_blocks(module, torch.bfloat16) == 3
    weights = [lin.weight for lin in parts]
    stacked = PackedLinear(torch.cat(weights), parts=weights)
    assert stacked.bf16_blocks and stacked.partial_ok
    alone = kernel.linear_blocks_bf16(x[:5], *pack_blocks_bf16(whole), 88, None)
    assert torch.equal(stacked(x[:5], stable=True), alone)
    with torch.no_grad():
        parts[0].weight.add_(1.0)  # (changed in place: its blocks no longer are its weight)
    assert not PackedLinear(parts[0].weight).bf16_blocks
    assert not PackedLinear(torch.cat(weights), parts=weights).bf16_blocks


def test_bf16_decoded_pairs_give_the_blocks_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks decoded once (``decode_blocks_bf16``), which the AVX512-BF16 chain's wide
    calls read instead of the blocks, give every row the bits the blocks give it, from one row
    up, over 4-bit and 8-bit blocks, an odd number of panels and row groups of every size;
    ``PackedLinear`` keeps them unless ``SOT_NO_BF16_PAIRS=1`` (or the AMX chain, which decodes
    the blocks at every row count, is on), and its wide calls read them."""
    _needs_bf16_blocks()
    kernel = cpu_kernels()
    before = kernel.amx_products()
    monkeypatch.setenv("SOT_NO_AMX", "1")
    try:
        _check_decoded_pairs(kernel, monkeypatch)
    finally:
        kernel.set_amx_products(before)


def _check_decoded_pairs(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    from sot.kernels.linear import PackedLinear, cast_keeping_blocks, pack_blocks_bf16

    kernel.set_amx_products(False)
    start = kernel.bf16_pairs_from_rows()
    gen = torch.Generator().manual_seed(5)
    n, k = 80, 96  # 5 panels
    scale, low, q4, q8 = random_blocks(n, k, gen)
    x = torch.randn(3 * start + 5, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    for w in ((scale * q4 + low).reshape(n, k), (scale * q8).reshape(n, k)):
        blocks = pack_blocks_bf16(w)
        pairs = kernel.decode_blocks_bf16(*blocks)
        assert pairs.dtype == torch.bfloat16 and pairs.numel() == blocks[1].numel() * 32
        one = torch.cat([kernel.linear_blocks_bf16(x[i:i + 1], *blocks, n, bias) for i in range(x.shape[0])])
        for rows in (1, start - 1, start, start + 1, 2 * start, 2 * start + 3, x.shape[0]):
            assert torch.equal(kernel.linear_blocks_bf16(x[:rows], *blocks, n, bias, pairs), one[:rows]), rows
            assert torch.equal(kernel.linear_blocks_bf16(x[-rows:], *blocks, n, None, pairs),
                               kernel.linear_blocks_bf16(x[-rows:], *blocks, n, None)), rows
        # the pairs path really runs: decoded pairs of other weights change a wide call only
        other = kernel.decode_blocks_bf16(*pack_blocks_bf16((scale * q8).reshape(n, k) * 2))
        assert torch.equal(kernel.linear_blocks_bf16(x[:start - 1], *blocks, n, None, other),
                           kernel.linear_blocks_bf16(x[:start - 1], *blocks, n, None))
        assert not torch.equal(kernel.linear_blocks_bf16(x[:start], *blocks, n, None, other),
                               kernel.linear_blocks_bf16(x[:start], *blocks, n, None))
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = (scale * q4 + low).reshape(n, k)
    cast_keeping_blocks(lin, torch.bfloat16)
    packed = PackedLinear(lin.weight)
    assert packed.bf16_blocks and packed.pairs is not None
    assert torch.equal(packed(x, stable=True), kernel.linear_blocks_bf16(x, *packed.packed, n, None))
    monkeypatch.setenv("SOT_NO_BF16_PAIRS", "1")
    assert PackedLinear(lin.weight).pairs is None
    monkeypatch.delenv("SOT_NO_BF16_PAIRS")
    if kernel.amx_supported():
        monkeypatch.delenv("SOT_NO_AMX")
        assert PackedLinear(lin.weight).pairs is None and kernel.amx_products()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_speculative_equals_plain_on_bf16_blocks(arch: str, bf16_chain: str) -> None:
    """bfloat16 over the GGUF blocks (a float32 model of exact blocks cast as ``load_model``
    casts a GGUF file's conversion), on each chain: speculative output equals plain decoding,
    alone and in a batch, and every logits row behind a committed token has the same bits
    (AVX512-BF16: wide passes reading the decoded pairs and narrow ones the blocks; AMX: every
    pass decoding the blocks into tiles)."""
    import copy

    from sot.kernels.linear import cast_keeping_blocks

    model = blockify(tiny_model(arch, seed=6, **({"sliding_window": 24} if arch == "mistral" else {})), head=True)
    cast = copy.deepcopy(model)
    assert cast_keeping_blocks(cast, torch.bfloat16) > 0
    target = TargetModel(cast)
    linears = [target.fast.lm_head] + [lin for lay in target.fast.layers for lin in (lay.qkv, lay.o, lay.gate_up,
                                                                                        lay.down)]
    assert all(lin.bf16_blocks for lin in linears) and target.fast.layer_call is not None
    # (AVX512-BF16: wide passes, from bf16_pairs_from_rows() rows, read the decoded pairs;
    # narrow ones the blocks. AMX: no pairs)
    assert all((lin.pairs is None) == (bf16_chain == "amx") for lin in linears)
    assert all(lin.storage[0].endswith("on AMX tiles") == (bf16_chain == "amx") for lin in linears)
    prompts = random_prompts(LENGTHS, seed=1)
    plain = run(target, NoDrafter(), prompts)
    assert [run(target, NoDrafter(), [p])[0] for p in prompts] == plain
    assert run(target, PromptLookupDrafter(), prompts) == plain
    assert run(target, RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=3), prompts) == plain
    rows = [traced(target, NoDrafter(), [p])[0] for p in prompts]
    spec = traced(target, RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.8, seed=9), prompts)
    assert all(torch.equal(a, b) for a, b in zip(rows, spec))


def test_block_rows_are_picked_as_if_packed_alone() -> None:
    """``select_block_rows`` (a draft head's rows of the target head's blocks) gives the blocks
    that packing those rows alone gives: Q4_1 and Q8_0, rows repeated and out of order, the
    last panel padded."""
    from sot.kernels.linear import pack_blocks_bf16, select_block_rows

    gen = torch.Generator().manual_seed(8)
    n, k = 70, 96
    scale, low, q4, q8 = random_blocks(n, k, gen)
    rows = torch.tensor([3, 69, 0, 17, 17, 40, 66])
    for w in ((scale * q4 + low).reshape(n, k), (scale * q8).reshape(n, k)):
        picked = select_block_rows(pack_blocks_bf16(w), rows)
        alone = pack_blocks_bf16(w[rows])
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(picked, alone))


def test_a_draft_head_reads_the_target_heads_blocks() -> None:
    """In the bfloat16 mode over GGUF blocks the state predictor's draft head (the target head's
    rows of the draft vocabulary) is read from those rows' blocks: the same weights, through
    the block kernel; its own weights are read rounded to Q8_0 blocks; speculative output
    still equals plain decoding."""
    _needs_bf16_blocks()
    import copy

    from sot.drafters.state import StateDrafter, new_predictor
    from sot.kernels.linear import cast_keeping_blocks, round_q8_0

    model = blockify(tiny_model("llama", seed=6), head=True)
    cast = copy.deepcopy(model)
    assert cast_keeping_blocks(cast, torch.bfloat16) > 0
    layers = (0, 1, 2)
    vocab = torch.tensor(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:40].tolist()))
    predictor = new_predictor(cast, layers, vocab, seed=1).cast_for_inference(torch.bfloat16)
    trained = {n: p.detach().clone() for n, p in predictor.named_parameters()}
    drafter = StateDrafter(predictor, top_k=3)
    head = predictor._packed["head"]
    assert head.bf16_blocks, "the draft head reads blocks"
    eye = torch.eye(predictor.head.shape[1]).to(torch.bfloat16)  # one product per output: the weight itself
    assert torch.equal(head._block(eye).T, predictor.head)
    # the predictor's own products read its weights rounded to Q8_0 blocks; the parameters stay as trained
    assert all(torch.equal(p, trained[n]) for n, p in predictor.named_parameters())
    for name in ("fuse", "inp", "qkv", "gate_up", "o_proj", "down_proj"):
        assert predictor._packed[name].bf16_blocks, name
    fuse = predictor.fuse.weight
    q, d, _ = round_q8_0(fuse.float())
    rounded = (q.float() * d[..., None]).reshape(-1, fuse.shape[1])[: fuse.shape[0]].to(torch.bfloat16)
    eye = torch.eye(fuse.shape[1]).to(torch.bfloat16)
    assert torch.equal(predictor._packed["fuse"]._block(eye).T, rounded) and not torch.equal(rounded, fuse)
    target = TargetModel(cast, state_layers=layers)
    prompts = random_prompts(LENGTHS, seed=1)
    assert run(target, drafter, prompts) == run(target, NoDrafter(), prompts)


def test_compiled_block_search_equals_the_pytorch_one() -> None:
    """``block_grid_f32`` (one pass per block) finds the blocks the PyTorch search finds, bit
    for bit: Q4_1 and Q8_0 grids (with rows of zero padding), Q5_0 (``q`` in -16..15, some
    blocks without -16) and Q4_0 (-8..7) held as 8-bit blocks, and no grid where the weights
    are none (one weight off by one ulp, Q4_1 blocks beside Q8_0 ones, random floats)."""
    from sot.kernels.linear import _block_grid_torch, _blocks_of, block_grid

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the compiled kernel is unavailable here")
    gen = torch.Generator().manual_seed(3)
    n, k = 37, 128  # 37 rows: padded to 48 with zero rows
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q4 = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q4[..., 0], q4[..., 1] = 0, 15
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q8[..., 0] = 127
    q5 = torch.randint(-15, 16, (n, k // 32, 32), generator=gen).float()
    q5[: n // 2, :, 0] = -16  # (the other half's largest |q| is at most 15)
    q5[n // 2:, :, 0] = 15
    q40 = torch.randint(-7, 8, (n, k // 32, 32), generator=gen).float()
    q40[..., 0], q40[..., 1] = -8, 3  # (no 7: the 4-bit search's spread misses its scale)
    grids = {"q4_1": scale * q4 + low, "q8_0": scale * q8, "q5_0": scale * q5, "q4_0": scale * q40}
    off = grids["q4_1"].clone()
    off[3, 1, 7] = torch.nextafter(off[3, 1, 7], torch.tensor(1.0))
    mixed = grids["q4_1"].clone()
    mixed[:5] = grids["q8_0"][:5]
    others = {"one ulp off": off, "mixed": mixed, "random": torch.randn(n, k // 32, 32, generator=gen)}
    found = {}
    for name, w in {**grids, **others}.items():
        blocks = _blocks_of(w.reshape(n, k), 16)
        mine, reference = kernel.block_grid_f32(blocks), _block_grid_torch(blocks)
        assert (not mine) == (reference is None), name
        found[name] = bool(mine)
        if mine:
            assert len(mine) == (2 if reference[2] is None else 3), name
            assert len(mine) == (3 if name == "q4_1" else 2), name  # (Q5_0 and Q4_0 as 8-bit blocks)
            for a, b in zip(mine, reference):  # q (int16), then scales and minimums as float32 bits
                assert a.dtype == b.dtype, name
                assert torch.equal(a, b) if a.dtype == torch.int16 else torch.equal(a.view(torch.int32),
                                                                                    b.view(torch.int32)), name
        assert (block_grid(w.reshape(n, k)) is None) == (reference is None), name
    assert found == {**dict.fromkeys(grids, True), **dict.fromkeys(others, False)}


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma2"])
def test_sliding_window_is_honoured(arch: str) -> None:
    """With every layer sliding (window W, two layers), a row at position p sees tokens
    p - 2(W - 1) .. p only. Changing a token before that leaves every logits row of the
    answer bit-identical, through prefill and through tree verification; widening the
    window lets the change through. (Mistral and Qwen3 run the fast path, Gemma 2 the generic one.)"""
    every_layer = {"qwen3": {"max_window_layers": 0},
                   "gemma2": {"layer_types": ["sliding_attention"] * 2}}.get(arch, {})
    window = 12
    prompt = random_prompts((30,), seed=8)[0]
    changed = list(prompt)
    changed[3] = (changed[3] + 1) % 90 + 3
    assert 3 < 30 - 1 - 2 * (window - 1), "the change must lie outside every answer row's reach"

    def answers(size: int) -> list[list[torch.Tensor]]:
        model = tiny_model(arch, seed=7, sliding_window=size, **every_layer)
        target = TargetModel(model)
        out = []
        for p in (prompt, changed):
            plain = traced(target, NoDrafter(), [p])[0]
            drafter = RandomTreeDrafter([plain.argmax(-1).tolist()], [len(p)], hit=0.8, seed=1)
            out.append([plain, traced(target, drafter, [p])[0]])
        return out

    (plain, spec), (plain_changed, spec_changed) = answers(window)
    assert torch.equal(plain, plain_changed) and torch.equal(spec, spec_changed)
    assert torch.equal(plain, spec)
    (plain, spec), (plain_changed, spec_changed) = answers(40)
    assert not torch.equal(plain, plain_changed) and not torch.equal(spec, spec_changed)
