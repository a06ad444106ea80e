"""GGUF files of the Gemma 2 and 3 families (and Llama's) load like the default model's and
decode exactly.

No Gemma 2 file is small enough to ship, so the tests write tiny ones the way llama.cpp's
converter lays them out (tensor names, Gemma's norms stored as ``1 + w``, Llama's query and key
rows in rotary pairs, the family's metadata and a sentencepiece vocabulary) and load them
through SoT's GGUF path."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import RandomTreeDrafter, blocks_reference, clone, hf_greedy, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel

gguf = pytest.importorskip("gguf")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def write_gguf(model: torch.nn.Module, path: Path, specials: list[str] = SPECIALS, skip: tuple[str, ...] = (),
               rope_scaling: float | None = None, quantized: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """Write ``model`` (a tiny Gemma 2, Gemma 3 or Llama model) as a float32 GGUF file; the
    vocabulary starts with ``specials`` (control tokens), tensors named in ``skip`` are left
    out, ``rope_scaling`` writes a linear RoPE factor as llama.cpp does for Gemma 3, and the
    tensors named in ``quantized`` are written as the given bytes (``[rows, row bytes]``) of the
    given format (``"Q4_K"``, ...), in the file's row order (a Llama query or key tensor's:
    :func:`llama_file_rows`)."""
    cfg = model.config
    family = {"gemma2": "gemma2", "gemma3_text": "gemma3", "llama": "llama"}[cfg.model_type]
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "llama": gguf.MODEL_ARCH.LLAMA}
    names = gguf.get_tensor_name_map(arch[family], cfg.num_hidden_layers)
    out = gguf.GGUFWriter(str(path), family)
    out.add_context_length(cfg.max_position_embeddings)
    out.add_embedding_length(cfg.hidden_size)
    out.add_block_count(cfg.num_hidden_layers)
    out.add_feed_forward_length(cfg.intermediate_size)
    out.add_head_count(cfg.num_attention_heads)
    out.add_head_count_kv(cfg.num_key_value_heads)
    out.add_key_length(cfg.head_dim)
    out.add_value_length(cfg.head_dim)
    out.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family != "llama":
        out.add_sliding_window(cfg.sliding_window)
    if family == "llama":
        out.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        out.add_rope_dimension_count(cfg.head_dim)
    elif family == "gemma2":
        out.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        out.add_final_logit_softcapping(cfg.final_logit_softcapping)
        out.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    else:
        out.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    if rope_scaling is not None:
        out.add_string(f"{family}.rope.scaling.type", "linear")
        out.add_float32(f"{family}.rope.scaling.factor", rope_scaling)
    tokens = specials + ["\u2581"] + [chr(c) for c in range(33, 33 + cfg.vocab_size - len(specials) - 1)]
    out.add_tokenizer_model("llama")
    out.add_token_list(tokens)
    out.add_token_scores([0.0] * len(tokens))
    out.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))  # 3: control
    out.add_bos_token_id(2)
    out.add_eos_token_id(1)
    out.add_unk_token_id(3)
    out.add_pad_token_id(0)
    for name, tensor in model.state_dict().items():
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or name in skip:  # (a tied head is the embeddings)
            continue
        base = names.get_name(name.removesuffix(".weight"))
        assert base is not None, name
        if quantized and name in quantized:
            kind, raw = quantized[name]
            out.add_tensor(base + ".weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        data = tensor.float().numpy()
        if name.endswith("norm.weight") and family != "llama":
            data = data + 1.0  # llama.cpp stores Gemma's (1 + w) norm weights
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = llama_file_rows(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        out.add_tensor(base + ".weight", data)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def llama_file_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """A Llama query or key weight's rows (``[heads * head_dim, ...]``) in llama.cpp's file order:
    each head's two rotary halves interleaved, as its converter writes them."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_loads_and_decodes_exactly(arch: str, tmp_path: Path, monkeypatch) -> None:
    from sot.models.loading import load_model

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    head_dim = 16  # a file says nothing of query_pre_attn_scalar: llama.cpp uses head_dim
    # Gemma 3 files carry no layer pattern: readers assume the family's (five sliding
    # layers, then a global one), so the model has six layers
    shape = {"num_hidden_layers": 6, "layer_types": None} if arch == "gemma3" else {}
    source = tiny_model(arch, seed=3, tie_word_embeddings=True, query_pre_attn_scalar=head_dim, **shape)
    assert "full_attention" in source.config.layer_types and "sliding_attention" in source.config.layer_types
    write_gguf(source, tmp_path / f"tiny-{arch}.gguf")
    loaded = load_model(str(tmp_path / f"tiny-{arch}.gguf"))
    model, cfg = loaded.model, loaded.model.config
    for field in ("sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(source.config, field), field
    state = model.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.allclose(state[name], tensor, atol=1e-6), name
    assert loaded.tokenizer("a")["input_ids"][0] == 2, "the file's BOS is prepended"

    prompts = random_prompts((7, 40), seed=2)
    reference = [hf_greedy(source, p, 30) for p in prompts]
    params = GenerationParams(max_new_tokens=30)
    for dtype in (torch.float32, torch.bfloat16):
        target = TargetModel(clone(model, dtype))
        plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
        if dtype == torch.float32:
            assert plain == reference
        pld = [r.token_ids for r in Engine(target, PromptLookupDrafter(), TreeBudget(16, 6)).generate(prompts, params)]
        rnd = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=1)
        spec = [r.token_ids for r in Engine(target, rnd, TreeBudget(16, 6)).generate(prompts, params)]
        assert pld == plain and spec == plain


def random_k_quant(kind: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """Random ``kind`` (a K-quant or IQ4 format) bytes of a ``[rows, cols]`` tensor (random codes
    and small scales) and gguf-py's dequantization of them."""
    weights, size, scales = {"Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)),
                             "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)), "IQ4_NL": (32, 18, (0,)),
                             "IQ4_XS": (256, 136, (0,))}[kind]  # (where its float16 scales are)
    blocks = rng.integers(0, 256, (rows * cols // weights, size), dtype=np.uint8)
    for at in scales:
        blocks[:, at:at + 2] = rng.uniform(0.002, 0.02, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(rows, cols)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quant_weights_are_multiplied_as_their_blocks(kind: str, tmp_path: Path, monkeypatch) -> None:
    """A GGUF file's K-quant and IQ4 weights (most of a published Q4_K_M, Q5_K_M, Q3_K_M or
    IQ4_XS file's layers) are read from the file: Q4_K's 4-bit codes with float32 scales and
    minimums per 32 inputs (products of a float16 and a 6-bit integer, not float16 values),
    Q5_K's the same with 5-bit codes in 8 bits, Q6_K's and Q3_K's codes in 8 bits with float32
    scales per 16 inputs (Q2_K's with minimums too), IQ4_XS's table values in 8 bits with
    float32 scales per 32, IQ4_NL's with float16 ones. Decoded to gguf-py's dequantized values,
    multiplied as the block formula says on both of SoT's paths, and decoded exactly. A weight
    changed in place loses them; the bfloat16 and 8-bit packers never get them."""
    import gc

    from sot.kernels import linear
    from sot.kernels.linear import PackedLinear, block_grid, pack_int8
    from sot.models.gguf_blocks import DECODERS
    from sot.models.loading import load_model

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    source = tiny_model("gemma3", seed=3, tie_word_embeddings=True, query_pre_attn_scalar=16, num_hidden_layers=6,
                        layer_types=None, intermediate_size=256)  # (Q4_K rows hold multiples of 256 weights)
    rng = np.random.default_rng(0)
    raw, grids = {}, {}
    for layer in (0, 3):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        rows, cols = source.state_dict()[name].shape
        data, weight = random_k_quant(kind, rows, cols, rng)
        raw[name] = (kind, data)
        q, d, m = DECODERS[kind](raw[name][1], rows, cols)
        q = q.reshape(rows, d.shape[1], -1)  # (blocks of 32, or Q6_K's halves of 16)
        grids[layer] = q, d, m
        assert q.shape[2] == (16 if kind in ("Q2_K", "Q3_K", "Q6_K") else 32) and q.abs().max() <= 127
        if kind == "Q5_K":
            assert q.max() == 31 and q.min() == 0, "the test's codes must need 5 bits"
        decoded = d[..., None] * q.float() + (0 if m is None else m[..., None])
        assert torch.equal(decoded.reshape(rows, cols), weight)
        assert bool((d.half().float() == d).all()) == (kind == "IQ4_NL"), "the test's scales must need float32"
        source.state_dict()[name].copy_(weight)
    write_gguf(source, tmp_path / "tiny-k.gguf", quantized=raw)
    loaded = load_model(str(tmp_path / "tiny-k.gguf"))
    target = TargetModel(loaded.model)
    downs = [layer.down for layer in target.fast.layers]
    assert [isinstance(lin.packed, tuple) for lin in downs] == [True, False, False, True, False, False]
    storage = target.weight_storage()  # (what `sot generate -v` reports)
    blocks = f"{4 if kind == 'Q4_K' else 8}-bit blocks"
    assert storage[blocks][0] == 2 * downs[0].weight.numel()
    assert storage[blocks][1] == sum(t.nbytes for lin in (downs[0], downs[3]) for t in lin.packed)
    assert sum(n for n, _ in storage.values()) == sum(p.numel() for p in (
        target.fast.lm_head.weight, *(lin.weight for lay in target.fast.layers
                                      for lin in (lay.qkv, lay.o, lay.gate_up, lay.down))))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    for layer in (0, 3):
        q, d, m = grids[layer]
        data, scale, _ = downs[layer].packed
        assert (scale.dtype, data.dtype) == (torch.float16 if kind == "IQ4_NL" else torch.float32,
                                             torch.uint8 if kind == "Q4_K" else torch.int8)
        assert downs[layer].packed[2].numel() == (0 if m is None else scale.numel())  # (the minimums)
        assert scale.shape[1] == d.shape[1]  # (a scale per 32 inputs, or per 16)
        expected = blocks_reference(x, q.float(), d[..., None], None if m is None else m[..., None],
                                    torch.zeros(q.shape[0]))
        for rows in (1, 2, 5, 7):
            assert torch.equal(downs[layer](x[:rows], True), expected[:rows])
    weight = loaded.model.model.layers[0].mlp.down_proj.weight
    # (the bfloat16 and 8-bit integer packers take float16 scales per 32 only: IQ4_NL's)
    assert (block_grid(weight) is None) == (pack_int8(weight) is None) == (kind != "IQ4_NL")
    generic = TargetModel(loaded.model, fast=False)
    prompts = random_prompts((7, 40), seed=2)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    assert [r.token_ids for r in Engine(generic, NoDrafter()).generate(prompts, params)] == plain
    rnd = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=1)
    assert [r.token_ids for r in Engine(target, rnd, TreeBudget(16, 6)).generate(prompts, params)] == plain
    with torch.no_grad():
        weight.mul_(1.0)  # (same values, but changed in place: the blocks no longer vouch for them)
    assert not isinstance(PackedLinear(weight).packed, tuple)
    registered = len(linear._REGISTERED)
    del loaded, target, generic, weight, downs
    gc.collect()
    assert len(linear._REGISTERED) == registered - 2  # (a freed weight's entry goes with it)


def test_stacked_k_quant_weights_share_their_blocks(tmp_path: Path, monkeypatch) -> None:
    """Weights the lean forward stacks into one product take their parts' file blocks: parts of
    one kind (Q4_K gate and up) as one grid; parts of several kinds (Q4_K query and key beside a
    Q6_K value, as in a Llama Q4_K_M file) as one product per run of one kind, outputs side by
    side. A Llama file's query and key rows are in rotary pairs, which the loader puts back in
    the model's order, blocks too. Each part's rows are the block formula's, the compiled layer
    call gives the Python loop's bits, and decoding stays exact."""
    from sot.models.gguf_blocks import q4_k_blocks, q6_k_blocks
    from sot.models.loading import load_model
    from sot.packing import pack_trees
    from sot.tree import tree_from_paths

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    source = tiny_model("llama", seed=4, tie_word_embeddings=True, num_hidden_layers=6, hidden_size=256,
                        intermediate_size=256)  # (4 heads of 64, 2 key/value heads)
    heads = {"q": source.config.num_attention_heads, "k": source.config.num_key_value_heads}

    def model_rows(t: np.ndarray, count: int) -> np.ndarray:  # a file's query/key rows in the model's order
        out = t.reshape(count, t.shape[0] // count // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        assert np.array_equal(llama_file_rows(out, count), t)
        return out

    rng = np.random.default_rng(1)
    raw, grids = {}, {0: [], 1: []}
    parts = {0: (("mlp.gate", "Q4_K"), ("mlp.up", "Q4_K")),
             1: (("self_attn.q", "Q4_K"), ("self_attn.k", "Q4_K"), ("self_attn.v", "Q6_K"))}
    for layer, named in parts.items():
        for part, kind in named:
            name = f"model.layers.{layer}.{part}_proj.weight"
            data, weight = random_k_quant(kind, *source.state_dict()[name].shape, rng)
            raw[name] = (kind, data)  # (the file's rows)
            grid = [t if t is None else t.numpy() for t in
                    (q4_k_blocks if kind == "Q4_K" else q6_k_blocks)(data, *weight.shape)]
            count = heads.get(part[-1]) if part.startswith("self_attn") else None
            if count:
                weight = torch.from_numpy(model_rows(weight.numpy(), count))
                grid = [t if t is None else model_rows(t, count) for t in grid]
            source.state_dict()[name].copy_(weight)
            q, d, m = (t if t is None else torch.from_numpy(np.ascontiguousarray(t)) for t in grid)
            grids[layer].append((q.reshape(q.shape[0], d.shape[1], -1), d, m))
    write_gguf(source, tmp_path / "tiny-stacked.gguf", quantized=raw)
    loaded = load_model(str(tmp_path / "tiny-stacked.gguf"))
    attention = loaded.model.model.layers[1].self_attn
    assert torch.equal(attention.q_proj.weight, source.model.layers[1].self_attn.q_proj.weight)
    target = TargetModel(loaded.model)
    stacked, mixed = target.fast.layers[0].gate_up, target.fast.layers[1].qkv
    assert isinstance(stacked.packed, tuple) and stacked.packed[1].dtype == torch.float32 and not stacked.segments
    assert [piece.storage[0] for piece in mixed.pieces] == ["4-bit blocks", "8-bit blocks"]
    assert [piece.weight.shape[0] for piece in mixed.segments] == [
        sum(q.shape[0] for q, _, _ in grids[1][:2]), grids[1][2][0].shape[0]]
    assert target.weight_storage()["8-bit blocks"][1] == sum(t.nbytes for t in mixed.segments[1].packed)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    for product, layer in ((stacked, 0), (mixed, 1)):
        expected = torch.cat([blocks_reference(x, q.float(), d[..., None], None if m is None else m[..., None],
                                               torch.zeros(q.shape[0])) for q, d, m in grids[layer]], dim=1)
        assert torch.equal(product(x, True), expected)
    prompts = random_prompts((7, 40), seed=2)

    def verified(model: TargetModel) -> torch.Tensor:  # logits of a pass over two trees
        cache = model.new_cache(2, 128)
        for b, prompt in enumerate(prompts):
            model.prefill(cache, b, torch.tensor(prompt))
            cache.set_length(b, len(prompt))
        trees = [tree_from_paths(5, [[6, 7, 8], [9]], max_nodes=8), tree_from_paths(3, [[4]], max_nodes=8)]
        batch = pack_trees(trees, cache, model)
        return model.verify(cache, batch.ids, batch.positions, batch.layout).logits

    monkeypatch.setenv("SOT_NO_LAYER_CALL", "1")
    loop = TargetModel(loaded.model)
    monkeypatch.delenv("SOT_NO_LAYER_CALL")
    assert target.fast.layer_call is not None and loop.fast.layer_call is None
    assert torch.equal(verified(target), verified(loop))
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    rnd = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=1)
    assert [r.token_ids for r in Engine(target, rnd, TreeBudget(16, 6)).generate(prompts, params)] == plain


def test_a_stack_of_several_block_kinds_runs_as_one_product_per_run() -> None:
    """A stacked product whose parts have blocks of several kinds (and a part with none) runs
    each run of one kind as its own product, over its rows of the stack and of the bias, outputs
    side by side: the same values as the parts multiplied one by one, every row count."""
    from sot.kernels.linear import PackedLinear, register_blocks
    from sot.models.gguf_blocks import DECODERS

    rng = np.random.default_rng(4)
    kinds = ["Q4_K", "Q4_K", "Q6_K", None, "Q5_K"]  # (None: float32 weights, no file blocks)
    parts = []
    for kind in kinds:
        if kind is None:
            parts.append(torch.from_numpy(rng.standard_normal((32, 256)).astype(np.float32)))
            continue
        raw, weight = random_k_quant(kind, 48, 256, rng)
        weight = weight.clone()
        register_blocks(weight, *DECODERS[kind](raw, 48, 256))
        parts.append(weight)
    bias = torch.from_numpy(rng.standard_normal(sum(p.shape[0] for p in parts)).astype(np.float32))
    stacked = PackedLinear(torch.cat(parts), bias, parts=parts)
    assert [piece.weight.shape[0] for piece in stacked.segments] == [96, 48, 32, 48]
    assert [piece.storage[0] for piece in stacked.segments] == [
        "4-bit blocks", "8-bit blocks", "float32 panels", "8-bit blocks"]
    x = torch.from_numpy(rng.standard_normal((9, 256)).astype(np.float32))
    starts = np.cumsum([0] + [p.shape[0] for p in parts])
    for rows in (1, 2, 7, 9):
        alone = [PackedLinear(torch.cat(parts[:2]), bias[:96], parts=parts[:2])(x[:rows], True)] + [
            PackedLinear(p, bias[starts[i]:starts[i + 1]])(x[:rows], True) for i, p in enumerate(parts) if i >= 2]
        assert torch.equal(stacked(x[:rows], True), torch.cat(alone, dim=1))


def test_gguf_files_are_read_whole_and_anew(tmp_path: Path, monkeypatch) -> None:
    """A file that lacks a tensor is refused (not filled at random); a file rewritten in place
    is converted again and its old conversion removed; Gemma's <end_of_turn> ends answers;
    Gemma 3's linear RoPE scaling of the global layers is read, so the output is the source's."""
    from sot.errors import ModelLoadError
    from sot.models.loading import load_model

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    shape = {"num_hidden_layers": 6, "layer_types": None}
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    source = tiny_model("gemma3", seed=3, tie_word_embeddings=True, query_pre_attn_scalar=16, rope_parameters=rope,
                        **shape)
    path = tmp_path / "model.gguf"
    write_gguf(source, path, skip=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(ModelLoadError, match="lacks weights of .*model.layers.1.mlp.down_proj.weight"):
        load_model(str(path))

    write_gguf(source, path, specials=SPECIALS + ["<start_of_turn>", "<end_of_turn>"])  # no scaling written
    first = load_model(str(path))
    assert first.model.config.rope_parameters["full_attention"]["rope_type"] == "default"
    assert sorted(first.model.generation_config.eos_token_id) == [1, 5], "<end_of_turn> (id 5) ends answers"
    write_gguf(source, path, rope_scaling=8.0)
    loaded = load_model(str(path))
    assert loaded.path != first.path and not first.path.exists(), "the rewritten file is converted again"
    assert loaded.model.config.rope_parameters["full_attention"] == rope["full_attention"]
    prompts = random_prompts((7, 40), seed=2)
    plain = Engine(TargetModel(loaded.model), NoDrafter()).generate(prompts, GenerationParams(max_new_tokens=20))
    assert [r.token_ids for r in plain] == [hf_greedy(source, p, 20) for p in prompts]


def test_a_file_changed_in_its_middle_has_a_new_key(tmp_path: Path, monkeypatch) -> None:
    """The conversion's key covers every byte (a layer changed in the middle of a large file,
    same size, is a new file), and is remembered for the unchanged file."""
    import os

    from sot.models.loading import _file_digest

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "big.gguf"
    data = bytearray(os.urandom(3 << 20))
    path.write_bytes(bytes(data))
    first = _file_digest(path)
    assert _file_digest(path) == first and (tmp_path / "cache" / "models" / "digests.json").is_file()
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert _file_digest(path) != first
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    assert _file_digest(copy) == _file_digest(path), "copies of one file share a conversion"


def test_a_damaged_or_refused_gguf_file_is_named_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    """A file cut short says so, with its size; a file of a family SoT refuses (Bloom, with
    ALiBi) is refused from its metadata, before its weights are dequantized and cached."""
    from sot.errors import ModelLoadError, UnsupportedModelError
    from sot.models.loading import load_model

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "cut.gguf"
    write_gguf(tiny_model("gemma2", seed=3, tie_word_embeddings=True, query_pre_attn_scalar=16), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut.gguf: .* \(is the file whole\? it has [\d,]+ bytes\)"):
        load_model(str(path))
    bloom = gguf.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")  # metadata alone: no weights are read
    bloom.add_context_length(64)
    bloom.add_embedding_length(64)
    bloom.add_block_count(2)
    bloom.add_feed_forward_length(256)
    bloom.add_head_count(4)
    bloom.add_layer_norm_eps(1e-5)
    bloom.add_tokenizer_model("gpt2")
    bloom.add_token_list(["<pad>", "<eos>"] + [chr(c) for c in range(33, 95)])
    bloom.add_token_types([3, 3] + [1] * 62)
    bloom.add_token_merges([])
    for step in (bloom.write_header_to_file, bloom.write_kv_data_to_file, bloom.write_tensors_to_file, bloom.close):
        step()
    with pytest.raises(UnsupportedModelError, match="cannot decode BloomForCausalLM exactly .*ALiBi"):
        load_model(str(tmp_path / "bloom.gguf"))
    assert not list((tmp_path / "cache" / "models").glob("bloom-*")), "nothing was converted"


def test_bench_runs_llamacpp_alone_on_the_files_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """``sot bench --methods llamacpp`` alone loads no engine, yet its prompts are token ids of
    the GGUF file's own tokenizer (llama.cpp is stood in for here: it is an optional extra)."""
    from sot.bench import runner
    from sot.bench.methods import BenchMethod, RunRecord
    from sot.models.loading import load_model
    from sot.prompts import encode

    monkeypatch.setenv("SOT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model("gemma2", seed=3, tie_word_embeddings=True, query_pre_attn_scalar=16), path)
    seen: list[list[int]] = []
    fits: list[int] = []

    class StandIn(BenchMethod):
        def __init__(self, gguf_path: str, threads: int) -> None:
            assert gguf_path == str(path) and threads == torch.get_num_threads()
            self.name = "llamacpp"

        def fit(self, positions: int) -> None:  # (llama.cpp's context is made for the longest prompt)
            fits.append(positions)

        def run(self, prompt, params) -> RunRecord:
            seen.append(list(prompt))
            return RunRecord(method=self.name, prompt_index=-1, prompt_id="", prompt_tokens=len(prompt),
                             new_tokens=2, wall_time=0.01, ttft=0.005, token_ids=[7, 8])

    monkeypatch.setattr(runner, "LlamaCppMethod", StandIn)
    texts = ["abc", "de fg"]
    (tmp_path / "p.jsonl").write_text("\n".join('{"prompt": "%s"}' % t for t in texts))
    cfg = runner.BenchConfig(prompts=str(tmp_path / "p.jsonl"), methods=("llamacpp",), model=str(path),
                             max_new_tokens=2, chat=False, warmup_tokens=1, out=str(tmp_path / "out"), notes=[])
    res = runner.run_bench(cfg)
    assert res["methods"]["llamacpp"]["new_tokens"] == 4
    tokenizer = load_model(str(path)).tokenizer
    assert seen[1:] == [encode(tokenizer, t, chat=False) for t in texts]  # (after the warm-up run)
    assert fits == [max(map(len, seen[1:])) + 2]


def test_the_k_quant_reader_refuses_what_is_not_a_whole_gguf_file(tmp_path: Path) -> None:
    """The header reader behind the K-quant blocks names a file that is not GGUF, and a
    truncated one, with the errors the loader turns into a warning (the weights then stay
    float32)."""
    import struct

    from sot.models.gguf_blocks import k_quant_tensors

    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        list(k_quant_tensors(tmp_path / "not.gguf"))
    source = tiny_model("gemma3", seed=3, tie_word_embeddings=True, num_hidden_layers=6, layer_types=None)
    write_gguf(source, tmp_path / "whole.gguf")
    assert list(k_quant_tensors(tmp_path / "whole.gguf")) == []  # (float32 tensors only)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:400])
    with pytest.raises(struct.error):
        list(k_quant_tensors(tmp_path / "cut.gguf"))
