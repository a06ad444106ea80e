"""Which models SoT runs, and how it refuses the others: a model is decoded only where its
answers equal transformers' (variants of a family the lean forward does not cover run on the
generic path); encoders, attention of a model's own and recurrent layers are refused by name;
an incomplete checkpoint is an error, not weights at random."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from helpers import char_tokenizer_dir, hf_greedy, random_prompts, tiny_model
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError, ModelLoadError, UnsupportedModelError
from sot.models.adapter import TargetModel
from sot.models.fast_llama import fast_path_gap


@pytest.mark.parametrize("variant, gap", [
    ({"attention_bias": True}, "an output-projection bias"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
])
def test_llama_variants_the_lean_forward_lacks_run_exactly(variant: dict, gap: str) -> None:
    model = tiny_model("llama", seed=1, **variant)
    if "attention_bias" in variant or "mlp_bias" in variant:  # (they start at zero)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 1.0)
    assert fast_path_gap(model) == gap
    prompts = random_prompts((5, 30), seed=4)
    reference = [hf_greedy(model, p, 20) for p in prompts]  # (before SoT takes over its attention)
    target = TargetModel(model)
    assert target.fast is None
    params = GenerationParams(max_new_tokens=20)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    assert plain == reference
    spec = Engine(target, PromptLookupDrafter(), TreeBudget(16, 6)).generate(prompts, params)
    assert [r.token_ids for r in spec] == plain
    assert fast_path_gap(tiny_model("llama")) is None and TargetModel(tiny_model("llama")).fast is not None


#: families beyond the lossless matrix's (tests/helpers.py ARCHS), each checked once: mixture
#: of experts (with a sliding window), post-norm blocks, logit scales, partial rotary, one
#: key-value head, windows shorter than the prompts
MORE = [
    ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=12)),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, logit_scale=0.5)),
    ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, sliding_window=12)),
    ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                                       multi_query=True)),
]


@pytest.mark.parametrize("config_class, model_class, extra", MORE, ids=[m[1] for m in MORE])
def test_more_families_decode_as_transformers_does(config_class, model_class, extra) -> None:
    """Plain decoding equals transformers' greedy answers and speculation equals plain
    decoding, in a batch whose prompts pass any window."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512) if "n_embd" not in extra else {}
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**SMALL, **base, **extra)).eval()
    with torch.no_grad():  # (larger weights than the init's: answers that vary, and near-ties that are rare)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    prompts = random_prompts((6, 40), seed=2)
    reference = [hf_greedy(model, p, 16) for p in prompts]
    target = TargetModel(model)
    params = GenerationParams(max_new_tokens=16)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    assert plain == reference
    spec = Engine(target, PromptLookupDrafter(), TreeBudget(16, 6)).generate(prompts, params)
    assert [r.token_ids for r in spec] == plain


SMALL = dict(vocab_size=96, bos_token_id=1, eos_token_id=2)
DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)


@pytest.mark.parametrize("name, config, cls, reason", [
    ("bloom", dict(hidden_size=64, n_layer=2, n_head=4), "BloomForCausalLM", "attention in its own modules"),
    ("mpt", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128), "MptForCausalLM",
     "attention in its own modules"),
    ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8), "MambaForCausalLM",
     "attention in its own modules"),
    ("recurrent_gemma", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=1, lru_width=64, attention_window_size=16),
     "RecurrentGemmaForCausalLM", "layers, whose state SoT does not carry"),
    ("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  is_decoder=True), "BertLMHeadModel", "bert is an encoder"),
    # (these decoded wrongly or crashed before they were refused)
    ("gpt_oss", dict(DENSE, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=12, layer_types=["sliding_attention", "full_attention"]),
     "GptOssForCausalLM", "sink logits"),
    ("diffllama", dict(DENSE, num_key_value_heads=2), "DiffLlamaForCausalLM", "call attention twice"),
    ("deepseek_v3", dict(DENSE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
     "DeepseekV3ForCausalLM", "multi-head latent attention"),
    ("gemma4", dict(DENSE, num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size_per_layer_input=96,
                    hidden_size_per_layer_input=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
     "Gemma4ForCausalLM", "keys differ in shape .*2 key heads of width 16, 2 key heads of width 32"),
    ("embedding_gemma", dict(DENSE, num_key_value_heads=1, head_dim=16, sliding_window=8,
                             use_bidirectional_attention=True, layer_types=["sliding_attention", "full_attention"]),
     "Gemma3ForCausalLM", "attention is bidirectional"),
    ("llama4", dict(DENSE, intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                    attention_chunk_size=8), "Llama4ForCausalLM", "chunked_attention layers .*fixed chunks"),
])
def test_models_sot_cannot_decode_exactly_are_refused_by_name(name, config, cls, reason) -> None:
    config_class = {"bloom": "BloomConfig", "mpt": "MptConfig", "mamba": "MambaConfig",
                    "recurrent_gemma": "RecurrentGemmaConfig", "bert": "BertConfig", "gpt_oss": "GptOssConfig",
                    "diffllama": "DiffLlamaConfig", "deepseek_v3": "DeepseekV3Config", "gemma4": "Gemma4TextConfig",
                    "embedding_gemma": "Gemma3TextConfig", "llama4": "Llama4TextConfig"}[name]
    model = getattr(transformers, cls)(getattr(transformers, config_class)(**SMALL, **config)).eval()
    with pytest.raises(UnsupportedModelError, match=f"cannot decode {cls} exactly: .*{reason}"):
        TargetModel(model)


def test_a_multimodal_gemma3_checkpoint_decodes_its_language_model(tmp_path: Path) -> None:
    """Gemma 3's 4B-27B checkpoints are ``Gemma3ForConditionalGeneration``, whose config keeps
    the language model's sizes in ``text_config``: SoT reads them there, so drafting (the cost
    model's and the predictor's view of the target) works as on a text-only model."""
    from sot import SoT
    from sot.drafters.state.config import StatePredictorConfig

    text = dict(SMALL, vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    cfg = StatePredictorConfig.for_target(model, (1, 2), 0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.window) == (4, 1, 16, 0)  # (the last layer is global)
    model.save_pretrained(tmp_path / "g3")
    char_tokenizer_dir(tmp_path / "g3")
    prompt = "hello there, hello there, hello"
    outputs = {drafter: SoT.load(str(tmp_path / "g3"), drafter=drafter, dtype="float32", device="cpu",
                                 prefix_cache_mb=0).generate([prompt], max_new_tokens=12)[0].token_ids
               for drafter in ("none", "pld")}
    assert outputs["pld"] == outputs["none"] and len(outputs["none"]) == 12


def test_incomplete_folders_and_adapters_are_errors(tmp_path: Path) -> None:
    from sot.models.loading import load_model

    headless = tmp_path / "headless"  # the base model alone: no language-model head
    tiny_model("llama").model.save_pretrained(headless)
    char_tokenizer_dir(headless)
    config = json.loads((headless / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="lacks weights of LlamaForCausalLM: lm_head.weight"):
        load_model(str(headless))

    bare = tmp_path / "bare"
    tiny_model("llama").save_pretrained(bare)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_model(str(bare))

    char_tokenizer_dir(bare)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ConfigError, match="has no adapter weights"):
        load_model(str(bare), lora=str(adapter))


def test_drafts_stop_at_the_models_last_position() -> None:
    """A request that fills the context exactly: trees are cut where positions end (GPT-2's
    learned position table has no row past them), so drafting equals plain decoding."""
    from sot.drafters import SuffixDrafter

    target = TargetModel(tiny_model("gpt2", seed=5))
    new = 8
    prompt = ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 100)[: target.max_positions - new]
    params = GenerationParams(max_new_tokens=new)
    plain = Engine(target, NoDrafter()).generate([prompt], params)[0].token_ids
    for drafter in (PromptLookupDrafter(), SuffixDrafter()):
        assert Engine(target, drafter, TreeBudget(16, 8)).generate([prompt], params)[0].token_ids == plain


def test_longrope_models_decode_within_their_short_factors() -> None:
    """transformers picks a longrope model's factors for a whole pass by its last position, so
    SoT keeps to the positions of the short factors, where a batch changes nothing."""
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                long_factor=[float(4 + i) for i in range(8)], original_max_position_embeddings=64)
    with pytest.warns(RuntimeWarning, match="within its first 64 positions"):
        target = TargetModel(tiny_model("phi3", seed=5, rope_parameters=rope, original_max_position_embeddings=64))
    assert target.max_positions == 64
    prompts = random_prompts((6, 40), seed=2)
    params = GenerationParams(max_new_tokens=20)
    alone = [Engine(target, NoDrafter()).generate([p], params)[0].token_ids for p in prompts]
    together = Engine(target, PromptLookupDrafter(), TreeBudget(16, 8)).generate(prompts, params)
    assert [r.token_ids for r in together] == alone


@pytest.mark.parametrize("arch", ["llama", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_gives_the_modules_bits(arch: str, dtype: torch.dtype) -> None:
    """The lean forward looks cos and sin up in a table the model's rotary module filled; at
    any positions, in any batch shape, across the table's growth, the bits are the module's."""
    from sot.models.fast_llama import RopeTable

    rotary = tiny_model(arch, seed=3, dtype=dtype).model.rotary_emb
    table = RopeTable(rotary)
    assert table.static
    h = torch.zeros(2, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for top in (7, 300, 1100):  # the table grows twice
            for shape in ((1, 1), (3, 5), (16, 4)):
                positions = torch.randint(0, top, shape, generator=gen)
                cos, sin = table(h, positions)
                want_cos, want_sin = rotary(h, positions)
                assert cos.dtype == want_cos.dtype == dtype
                assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert table._tables[dtype][0].shape[0] >= 1100
    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                    long_factor=[float(4 + i) for i in range(8)], original_max_position_embeddings=64)
    dynamic = tiny_model("phi3", seed=5, rope_parameters=longrope, original_max_position_embeddings=64)
    assert not RopeTable(dynamic.model.rotary_emb).static  # (frequencies follow the length: the module runs)
