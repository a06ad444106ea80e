"""Pure tree functions and the KV cache operations."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sot.cache import KVCache
from sot.tree import ancestor_table, chain_tree, leaf_paths, tree_from_parents, tree_from_paths, tree_mask


def test_tree_from_paths_merges_shared_prefixes() -> None:
    tree = tree_from_paths(9, [[1, 2, 3], [1, 4], [5]], max_nodes=10)
    assert tree.tokens == [9, 1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 1, 0]
    assert tree.depths == [0, 1, 2, 3, 2, 1]
    assert tree.children()[1] == [2, 4]


def test_tree_budget_keeps_earlier_paths() -> None:
    tree = tree_from_paths(0, [[1, 2, 3], [4, 5]], max_nodes=5)
    assert tree.tokens == [0, 1, 2, 3, 4]


def test_mask_paths_and_ancestors() -> None:
    tree = tree_from_parents([7, 1, 2, 3], [-1, 0, 0, 1])
    mask = tree_mask(tree)
    assert mask[3].tolist() == [True, True, False, True]
    assert mask.diagonal().all()
    assert leaf_paths(tree).tolist() == [[0, 2, -1], [0, 1, 3]]
    assert ancestor_table(tree, 4)[3] == [0, 1, 3, -1]


def test_invalid_trees_are_rejected() -> None:
    with pytest.raises(ValueError):
        tree_from_parents([1, 2], [-1, 1])
    with pytest.raises(ValueError):
        tree_from_parents([1, 2], [0, -1])
    with pytest.raises(ValueError):
        tree_from_parents([], [])


def test_chain_tree() -> None:
    tree = chain_tree(5, [6, 7])
    assert tree.parents == [-1, 0, 1] and tree.max_depth == 2


def test_cache_keep_rows_moves_accepted_rows_per_sequence() -> None:
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=2, capacity=32)
    cache.set_length(0, 5)
    cache.set_length(1, 3)
    slots = torch.tensor([[5, 6, 7, 8], [3, 4, 5, 6]])
    rows = torch.arange(8, dtype=torch.float32).view(2, 1, 4, 1).expand(2, 1, 4, 2)
    for layer in range(2):
        cache.write(layer, slots, rows + layer, rows)
    cache.keep_rows([[5, 7, 8], []])
    assert cache.lengths == [8, 3]
    k, _ = cache.layer(1)
    assert k[0, 0, 5:8, 0].tolist() == [1.0, 3.0, 4.0]  # rows 0, 2, 3 (+1 for layer 1)
    assert k[1, 0, 3:7, 0].tolist() == [5.0, 6.0, 7.0, 8.0]  # untouched
    cache.truncate(0, 6)
    assert cache.lengths[0] == 6
    with pytest.raises(ValueError):
        cache.truncate(0, 7)
    assert cache.capacity % 64 == 0


def test_ngram_index_finds_what_a_full_scan_ranks_first() -> None:
    """The incremental n-gram index of a growing context gives, at every length, the
    continuation that prompt lookup's full scan ranks first."""
    import random

    from sot.drafters.pld import NgramIndex, PromptLookupDrafter

    rng = random.Random(4)
    scan = PromptLookupDrafter()
    for trial in range(20):
        context = [rng.randrange(6) for _ in range(3)]
        index = NgramIndex()
        for _ in range(60):
            context += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
            found = scan.candidates(context, 5)
            assert index.best(context, 5) == (found[0] if found else [])


def _tiles(keys: torch.Tensor) -> torch.Tensor:
    """Keys written ``[B, Hkv, D, S]`` (dimension-major, easy to index by slot) in the kernel's
    layout, tiles of 16 slots: ``[B, Hkv, S' / 16, D, 16]``, ``S'`` the next multiple of 16,
    zeros past ``S``."""
    batch, heads, dim, slots = keys.shape
    padded = torch.nn.functional.pad(keys, (0, -slots % 16))
    return padded.view(batch, heads, dim, -1, 16).permute(0, 1, 3, 2, 4).contiguous()


def _attend(q, keys, values, *args):
    """The compiled kernel on keys given ``[B, Hkv, D, S]`` (see :func:`_tiles`)."""
    from sot.kernels import cpu_kernels

    return cpu_kernels().tree_attention_exact(q, _tiles(keys), values, *args)


def _kernel_attention(q, keys, values, length, paths, window=0):
    """The compiled kernel over one sequence: rows whose ancestors (root first) are ``paths``."""
    width = max(len(p) for p in paths)
    anc = torch.full((1, len(paths), width), -1, dtype=torch.long)
    for r, path in enumerate(paths):
        anc[0, r, : len(path)] = torch.tensor(path)
    return _attend(q, keys, values, torch.tensor([length]), anc, torch.tensor([len(paths)]), 0.125, window, 0.0)


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("length,window", [(100, 0), (703, 0), (703, 300), (1000, 0)])
def test_tree_rows_over_many_keys_equal_plain_decoding_and_true_attention(length: int, window: int, dim: int) -> None:
    """Rows with many keys are attended in two halves split where their position says (so
    one-row passes spread over the threads): a tree row still gives the bits plain decoding
    gives its token, and the merged halves are the attention computed in float64. (A head dim
    of 64 also takes a one-row pass through the loops that read two chunks of a key a pass.)"""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, dim, 1040, generator=gen)  # [B, Hkv, D, S] (tiled by _attend)
    values = torch.randn(1, 2, 1024, dim, generator=gen)
    q = torch.randn(1, 6, 4, dim, generator=gen) * 3  # 3 query heads per KV head, 4 tree rows
    paths = [[length], [length, length + 1], [length, length + 2], [length, length + 1, length + 3]]
    tree = _kernel_attention(q, keys, values, length, paths, window)
    for r, path in enumerate(paths):
        # plain decoding of the same token: its ancestors committed at their positions
        k2, v2 = keys.clone(), values.clone()
        pos = length + len(path) - 1
        k2[..., length:pos + 1] = keys[..., path]
        v2[:, :, length:pos + 1] = values[:, :, path]
        plain = _kernel_attention(q[:, :, r:r + 1].contiguous(), k2, v2, pos, [[pos]], window)
        assert torch.equal(plain[0, 0], tree[0, r]), f"row {r}"
        first = max(0, pos - window + 1) if window else 0
        kk = k2[0, :, :, first:pos + 1].double().repeat_interleave(3, dim=0)  # [H, D, n]
        vv = v2[0, :, first:pos + 1].double().repeat_interleave(3, dim=0)  # [H, n, D]
        weights = torch.softmax(torch.einsum("hd,hdn->hn", q[0, :, r].double(), kk) * 0.125, dim=-1)
        expected = torch.einsum("hn,hnd->hd", weights, vv)
        assert torch.allclose(tree[0, r].double(), expected, atol=1e-5, rtol=1e-4), f"row {r}"


@pytest.mark.parametrize("dim", [48, 64])
@pytest.mark.parametrize("group", [1, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prompts_chain_of_rows_gives_each_token_the_bits_of_plain_decoding(group: int, dim: int,
                                                                              dtype: torch.dtype) -> None:
    """A prompt is read in chains of up to 64 rows, each row seeing the ones before it as its
    ancestors: every row equals plain decoding of its token (the ancestors committed), bit for
    bit, for 1-8 query heads per KV head (the loops that add a row's ancestors take several
    heads and chunks of the value rows a pass, or one chunk, or none), an even and an odd
    number of 16-dimension chunks, across the halves a row of many keys splits into, and
    where several register tiles of rows share a task and take its keys a block at a time,
    over a float32 and a bfloat16 cache; and an ancestor past the cache is refused."""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(group * dim)
    kv, rows = 2, 40
    for length in (30, 240, 1100):  # (rows past 256 keys split into halves; past 1,024, 8 rows share a task)
        slots = length + rows + 16
        keys = torch.randn(1, kv, dim, slots, generator=gen).to(dtype)
        values = torch.randn(1, kv, slots, dim, generator=gen).to(dtype)
        q = (torch.randn(1, kv * group, rows, dim, generator=gen) * 3).to(dtype)
        paths = [list(range(length, length + r + 1)) for r in range(rows)]
        chain = _kernel_attention(q, keys, values, length, paths)
        for r in range(rows):
            plain = _kernel_attention(q[:, :, r:r + 1].contiguous(), keys, values, length + r, [[length + r]])
            assert torch.equal(plain[0, 0], chain[0, r]), (length, r)
    with pytest.raises(RuntimeError, match="past the cache"):
        _kernel_attention(q[:, :, :1].contiguous(), keys, values, length, [[slots]])


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_attended_as_one_tile_keep_the_bits_they_have_alone(group: int, dtype: torch.dtype, dim: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes a tree's rows several at a time (each key loaded once for all of
    them): every row of a 13-row tree, in a pass with a second sequence and padding rows,
    equals the row attended alone, bit for bit, for 1-6 query heads per KV head, with rows
    whose halves split at different keys (lengths around 256) and under a sliding window; a
    bfloat16 cache gives what a float32 one holding the same values gives. A row alone with
    up to 3 query heads per KV head takes other loops (two chunks of a key a pass; with a
    head dim of 64, also for the values): the same operations in the same order."""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(group)
    kv, slots, rows = 2, 640, 13
    keys = torch.randn(2, kv, dim, slots + 16, generator=gen)
    values = torch.randn(2, kv, slots, dim, generator=gen)
    q = (torch.randn(2, kv * group, rows + 2, dim, generator=gen) * 3).to(dtype)
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # depths 0-6
    for lengths, window in (((250, 37), 0), ((500, 263), 0), ((500, 263), 200)):
        anc = torch.full((2, rows + 2, 8), -1, dtype=torch.long)
        real = torch.tensor([rows, 5])
        for b in range(2):
            for r in range(int(real[b])):
                path, node = [], r
                while node >= 0:
                    path.append(lengths[b] + node)
                    node = parents[node]
                anc[b, r, :len(path)] = torch.tensor(path[::-1])
        whole = _attend(q, keys, values, torch.tensor(lengths), anc, real, 0.125,
                                                   window, 0.0)
        assert whole.dtype == dtype and not whole[1, 5:].any(), "padding rows must be zeros"
        for b in range(2):
            for r in range(int(real[b])):
                alone = _attend(
                    q[b:b + 1, :, r:r + 1].contiguous(), keys[b:b + 1], values[b:b + 1],
                    torch.tensor([lengths[b]]), anc[b:b + 1, r:r + 1], torch.tensor([1]), 0.125, window, 0.0)
                assert torch.equal(alone[0, 0], whole[b, r]), (lengths, window, b, r)
        if dtype == torch.bfloat16:  # a bfloat16 cache: rows keep their bits there too
            half_k, half_v = keys.bfloat16(), values.bfloat16()
            args = (torch.tensor(lengths), anc, real, 0.125, window, 0.0)
            half = _attend(q, half_k, half_v, *args)
            for b in range(2):
                for r in range(int(real[b])):
                    alone = _attend(
                        q[b:b + 1, :, r:r + 1].contiguous(), half_k[b:b + 1], half_v[b:b + 1],
                        torch.tensor([lengths[b]]), anc[b:b + 1, r:r + 1], torch.tensor([1]), 0.125, window, 0.0)
                    assert torch.equal(alone[0, 0], half[b, r]), ("bf16 cache", lengths, window, b, r)
            wide = _attend(q, half_k.float(), half_v.float(), *args)
            if cpu_kernels().attention_pairs_bf16():  # scores by pair dot products: other rounding
                assert torch.allclose(half.float(), wide.float(), atol=0.02, rtol=0.02)
                # SOT_NO_BF16_ATTENTION (read at each call) turns them off: the float32 loops
                monkeypatch.setenv("SOT_NO_BF16_ATTENTION", "1")
                assert not cpu_kernels().attention_pairs_bf16()
                half = _attend(q, half_k, half_v, *args)
                monkeypatch.delenv("SOT_NO_BF16_ATTENTION")
            assert torch.equal(half, wide)  # the float32 loops on the widened values: the same bits


def test_a_bfloat16_cache_keeps_plain_decodings_bits_at_the_cache_end() -> None:
    """With a bfloat16 cache (scored by bfloat16 pair dot products where the CPU has them),
    tree rows equal plain decoding of their tokens bit for bit, also where the cache ends right
    after the tree under a sliding window (a row's keys then start inside a tile of the cache's
    last ones), and they are the attention of the bfloat16 values computed in float64, within
    bfloat16's rounding."""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(3)
    dim = 64
    q = (torch.randn(1, 6, 4, dim, generator=gen) * 16).bfloat16()  # (large scores: a last-bit change shows)
    # room for whole blocks past the tree, or none; a sliding window of 301 keys (each row's
    # first key, where its pairs start, then depends on its depth)
    for slots, length, window in ((1040, 1000, 0), (1008, 1004, 301), (1040, 1000, 301)):
        paths = [[length], [length, length + 1], [length, length + 2], [length, length + 1, length + 3]]
        keys = torch.randn(1, 2, dim, slots, generator=gen).bfloat16()
        values = torch.randn(1, 2, slots, dim, generator=gen).bfloat16()
        tree = _kernel_attention(q, keys, values, length, paths, window)
        for r, path in enumerate(paths):
            pos = length + len(path) - 1
            k2, v2 = keys.clone(), values.clone()
            k2[..., length:pos + 1] = keys[..., path]
            v2[:, :, length:pos + 1] = values[:, :, path]
            plain = _kernel_attention(q[:, :, r:r + 1].contiguous(), k2, v2, pos, [[pos]], window)
            assert torch.equal(plain[0, 0], tree[0, r]), (slots, window, r)
            first = max(0, pos - window + 1) if window else 0
            kk = k2[0, :, :, first:pos + 1].double().repeat_interleave(3, dim=0)
            vv = v2[0, :, first:pos + 1].double().repeat_interleave(3, dim=0)
            weights = torch.softmax(torch.einsum("hd,hdn->hn", q[0, :, r].double(), kk) * 0.125, dim=-1)
            expected = torch.einsum("hn,hnd->hd", weights, vv)
            assert torch.allclose(tree[0, r].double(), expected, atol=0.02, rtol=0.02), (slots, window, r)
    # Short contexts in a cache whose values end after the tree (its keys' last tile padded)
    # against the same in a roomy one: many sequences, so that any change of arithmetic at the
    # cache's end would change some bfloat16 output.
    batch, rows, length = 128, 4, 10
    q = (torch.randn(batch, 12, rows, dim, generator=gen) * 3).bfloat16()
    keys = torch.randn(batch, 4, dim, 32, generator=gen).bfloat16()
    values = torch.randn(batch, 4, 32, dim, generator=gen).bfloat16()
    anc = torch.full((batch, rows, rows), -1, dtype=torch.long)
    for r in range(rows):
        anc[:, r, :r + 1] = torch.arange(length, length + r + 1)
    args = (torch.full((batch,), length), anc, torch.full((batch,), rows), 0.125, 0, 0.0)
    roomy = _attend(q, keys, values, *args)
    end = length + rows
    short = _attend(q, keys[..., :end].contiguous(), values[:, :, :end].contiguous(), *args)
    assert torch.equal(short, roomy)
    # Tree rows after an odd number of committed keys (a pair of keys straddles the committed
    # ones and the row's ancestors) against plain decoding of each row's token.
    length = 11
    anc = torch.full((batch, rows, rows), -1, dtype=torch.long)
    for r in range(rows):
        anc[:, r, :r + 1] = torch.arange(length, length + r + 1)
    tree = _attend(q, keys, values, torch.full((batch,), length), anc,
                                              torch.full((batch,), rows), 0.125, 0, 0.0)
    for r in range(rows):
        plain = _attend(q[:, :, r:r + 1].contiguous(), keys, values,
                                                   torch.full((batch,), length + r),
                                                   anc[:, r:r + 1, r:r + 1].contiguous(),
                                                   torch.ones(batch, dtype=torch.long), 0.125, 0, 0.0)
        assert torch.equal(plain[:, 0], tree[:, r]), r
        kk = keys[..., :length + r + 1].double().repeat_interleave(3, dim=1)  # [batch, H, D, n]
        vv = values[:, :, :length + r + 1].double().repeat_interleave(3, dim=1)  # [batch, H, n, D]
        weights = torch.softmax(torch.einsum("bhd,bhdn->bhn", q[:, :, r].double(), kk) * 0.125, dim=-1)
        expected = torch.einsum("bhn,bhnd->bhd", weights, vv)
        assert torch.allclose(tree[:, r].double(), expected, atol=0.03, rtol=0.02), r


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float32_rows_over_a_smaller_cache_take_its_values_exactly(kv: torch.dtype) -> None:
    """Float32 rows over a float16 or bfloat16 cache (``kv_cache_dtype``) give the bits of the
    same rows over a float32 cache holding the same values: loads widen exactly and the
    arithmetic is the float32 kernel's, for tree rows, under a window, with 1 and 3 query heads
    per KV head. rope_write stores the rounding of what it stores in float32."""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(6)
    for group, window in ((3, 0), (3, 201), (1, 0)):
        keys = torch.randn(1, 2, 64, 320, generator=gen).to(kv)
        values = torch.randn(1, 2, 320, 64, generator=gen).to(kv)
        q = torch.randn(1, 2 * group, 4, 64, generator=gen) * 3
        paths = [[300], [300, 301], [300, 302], [300, 301, 303]]
        small = _kernel_attention(q, keys, values, 300, paths, window)
        assert small.dtype == torch.float32
        assert torch.equal(small, _kernel_attention(q, keys.float(), values.float(), 300, paths, window))
    qkv = torch.randn(1, 3, 6 + 2 * 2, 64, generator=gen)  # 6 query heads, 2 KV heads, 3 rows
    cos, sin = torch.randn(1, 3, 64, generator=gen), torch.randn(1, 3, 64, generator=gen)
    slots = torch.tensor([[17, 18, 40]])
    caches = {dt: (torch.zeros(1, 2, 4, 64, 16, dtype=dt), torch.zeros(1, 2, 64, 64, dtype=dt))
              for dt in (torch.float32, kv)}
    qs = {dt: cpu_kernels().rope_write(qkv, cos, sin, *caches[dt], slots, 6) for dt in caches}
    assert torch.equal(qs[kv], qs[torch.float32])  # q is float32 either way
    assert torch.equal(caches[kv][0], caches[torch.float32][0].to(kv)) and caches[kv][0].any()
    assert torch.equal(caches[kv][1], caches[torch.float32][1].to(kv))


def test_tiled_keys_hold_what_plain_keys_hold_through_every_cache_operation() -> None:
    """The kernel's tiled keys (``[L, B, Hkv, S / 16, D, 16]``) against keys stored by slot,
    through the same operations: writes of tree rows, spans read and written across tile
    borders (the prefix cache), accepted rows moved down, a sequence moved to another and the
    cache grown. Every slot's key is the same in both, read back by ``read_span``."""
    gen = torch.Generator().manual_seed(0)
    caches = [KVCache(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=16, capacity=64, tiled_keys=tiled)
              for tiled in (False, True)]
    assert caches[1].keys.shape == (2, 3, 2, 4, 16, 16) and caches[1].capacity == 64

    def same(cache_a: KVCache, cache_b: KVCache, batch: int, slots: int) -> bool:
        return all(torch.equal(cache_a.read_span(b, 0, slots)[0], cache_b.read_span(b, 0, slots)[0]) and
                   torch.equal(cache_a.read_span(b, 0, slots)[1], cache_b.read_span(b, 0, slots)[1])
                   for b in range(batch))

    for layer in range(2):  # three sequences' rows at slots 0-20 (one tile and part of the next)
        slots = torch.arange(21).repeat(3, 1)
        k, v = torch.randn(3, 2, 21, 16, generator=gen), torch.randn(3, 2, 21, 16, generator=gen)
        for cache in caches:
            cache.write(layer, slots, k, v)
    for cache in caches:
        cache.lengths = [13, 13, 13]
    assert same(*caches, 3, 64)
    span = caches[0].read_span(1, 5, 19)  # slots 5-18, across a tile border
    assert torch.equal(caches[1].read_span(1, 5, 19)[0], span[0])
    for cache in caches:
        cache.write_span(2, 27, *span)  # into the middle of tiles 1 and 2
        cache.keep_rows([[13, 15], [14, 18, 20], []])  # moves 15 -> 14; 14 -> 13, 18 -> 14, 20 -> 15
        cache.move(1, 0)
    assert caches[0].lengths == caches[1].lengths == [16, 16, 13]
    assert same(*caches, 3, 64)
    grown = [cache.resized(4, 200) for cache in caches]
    assert grown[1].keys.shape[3] == grown[1].capacity // 16
    assert same(*grown, 3, 64) and not grown[1].keys[:, 3].any()


def test_float32_rows_keep_their_bits_when_their_keys_start_inside_a_tile() -> None:
    """A float32 cache that ends right after a tree, under a sliding window: each row's keys
    start inside a tile (scored from the tile's first key, the ones before the window dropped),
    at a different lane for each depth, up to the cache's last tile. Every row equals the same
    row alone and plain decoding of its token, bit for bit, and the attention computed in
    float64 over its window."""
    from sot.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(4)
    length, window, dim = 1004, 301, 64
    keys = torch.randn(1, 2, dim, 1008, generator=gen)
    values = torch.randn(1, 2, 1008, dim, generator=gen)
    q = torch.randn(1, 6, 4, dim, generator=gen) * 3
    paths = [[length], [length, length + 1], [length, length + 2], [length, length + 1, length + 3]]
    tree = _kernel_attention(q, keys, values, length, paths, window)
    for r, path in enumerate(paths):
        alone = _kernel_attention(q[:, :, r:r + 1].contiguous(), keys, values, length, [path], window)
        assert torch.equal(alone[0, 0], tree[0, r]), r
        pos = length + len(path) - 1
        k2, v2 = keys.clone(), values.clone()
        k2[..., length:pos + 1] = keys[..., path]
        v2[:, :, length:pos + 1] = values[:, :, path]
        plain = _kernel_attention(q[:, :, r:r + 1].contiguous(), k2, v2, pos, [[pos]], window)
        assert torch.equal(plain[0, 0], tree[0, r]), r
        first = pos - window + 1
        kk = k2[0, :, :, first:pos + 1].double().repeat_interleave(3, dim=0)  # [H, D, n]
        vv = v2[0, :, first:pos + 1].double().repeat_interleave(3, dim=0)  # [H, n, D]
        weights = torch.softmax(torch.einsum("hd,hdn->hn", q[0, :, r].double(), kk) * 0.125, dim=-1)
        assert torch.allclose(tree[0, r].double(), torch.einsum("hn,hnd->hd", weights, vv), atol=1e-4), r


def test_kernel_sources_are_staged_once_so_a_build_outlives_new_file_times(tmp_path) -> None:
    """The kernels compile from copies kept in their build folder: a checkout that gives the
    package's sources new times leaves the copies (and so the build) untouched, and a copy
    that differs from its source is replaced."""
    import os

    from sot.kernels import HEADERS, SOURCES, _stage

    import sot.kernels

    here = Path(sot.kernels.__file__).parent
    staged = _stage(tmp_path)
    assert [p.name for p in staged] == list(SOURCES)
    copies = {name: tmp_path / "src" / name for name in SOURCES + HEADERS}
    for name, copy in copies.items():
        assert copy.read_bytes() == (here / name).read_bytes()
        os.utime(copy, (1_000_000_000, 1_000_000_000))  # an old build's time
    copies["common.h"].write_bytes(b"stale")
    os.utime(copies["common.h"], (1_000_000_000, 1_000_000_000))
    _stage(tmp_path)
    assert copies["common.h"].read_bytes() == (here / "common.h").read_bytes()
    assert copies["common.h"].stat().st_mtime > 1_000_000_000
    for name in SOURCES:
        assert copies[name].stat().st_mtime == 1_000_000_000
    assert not [p for p in (tmp_path / "src").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("tiled", [False, True], ids=["slots", "tiled"])
def test_a_grown_cache_keeps_every_held_row_and_grows_geometrically(tiled: bool) -> None:
    """A cache asked for one sequence more at a time doubles its sequences up to ``most``
    (then grows to what is asked), and capacity by half. A copy keeps each sequence's rows up
    to its length bit for bit, and copies no slot past the longest sequence's (rounded to a
    key tile): those stay zero, as masked slots must stay finite."""
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=16, capacity=64, tiled_keys=tiled)
    sizes = [cache.batch_size]
    for b in range(2, 15):
        cache = cache.grown_to(b, 64, most=12)
        sizes.append(cache.batch_size)
    assert sizes == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 13, 14]
    assert cache.grown_to(3, 64) is cache, "a cache that holds the request is kept"
    assert cache.grown_to(14, 65).capacity == 128, "capacity grows by at least half (rounded to 64 slots)"
    k, v = torch.randn(14, 2, 40, 16, generator=gen), torch.randn(14, 2, 40, 16, generator=gen)
    for layer in range(2):
        cache.write(layer, torch.arange(40).repeat(14, 1), k, v)
    cache.lengths = [17 + b for b in range(14)]  # rows past each length are a dead tree's scratch
    grown = cache.grown_to(20, 200)
    assert grown.batch_size == 28 and grown.capacity == 256 and grown.lengths[:14] == cache.lengths
    for b in range(14):
        n = cache.lengths[b]
        assert all(torch.equal(x, y) for x, y in zip(grown.read_span(b, 0, n), cache.read_span(b, 0, n))), b
    held = torch.zeros(256, dtype=torch.bool)
    held[: 32] = True  # up to the longest sequence (30 slots), rounded to a key tile
    keys = grown.keys if not tiled else grown.keys.transpose(-1, -2).flatten(3, 4)  # -> [L, B, H, S, D]
    assert not keys[:, :, :, ~held].any() and not grown.values[:, :, :, ~held].any()
    assert not keys[:, 14:].any() and not grown.values[:, 14:].any()
