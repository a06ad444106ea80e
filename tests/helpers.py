"""Test helpers: tiny random models of several architectures, a char tokenizer, and a
drafter that proposes random trees (so acceptance and rejection both happen often)."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import torch
import transformers

from sot.drafters.base import DraftInput, Drafter, DrafterKind, TreeBudget
from sot.tree import DraftTree, tree_from_parents

VOCAB = 96

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    # Windows shorter than the prompts plus answers of the tests, so that they cut.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=12)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict()),
    # Llama 3.x rope scaling (its long-context frequency bands start inside the tests'
    # lengths) and tied embeddings
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    # q/k norms; the second layer slides (layers from max_window_layers on)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                                                      sliding_window=10, max_window_layers=1)),
    # a sliding and a global layer, attention-logit and final-logit soft caps (small enough to
    # change the tokens of this tiny model), (1 + w) norms
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
        attn_logit_softcapping=0.5, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"])),
}


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> torch.nn.Module:
    """A 2-layer random causal LM of the given family, in eval mode (``overrides``: config
    fields that replace the family's test defaults)."""
    cfg_name, model_name, extra = ARCHS[arch]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    # Larger weights give peakier, more realistic distributions than the init default.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype)


def trained_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with random norm weights (in place; returns the model): Gemma's ``(1 + w)``
    norms start at ``w = 0``, where a forward that dropped or misplaced one would not show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def blockify(model: torch.nn.Module, head: bool = False) -> torch.nn.Module:
    """``model`` with every decoder-layer weight (and with ``head`` the output layer's) rounded
    to a grid of exact GGUF Q4_1 blocks of 32 inputs, as a model dequantized from a GGUF file
    has them (in place; returns the model)."""
    modules = list(model.model.layers.modules()) + ([model.lm_head] if head else [])
    for lin in modules:
        if isinstance(lin, torch.nn.Linear):
            w = lin.weight.data.reshape(lin.weight.shape[0], -1, 32)
            low = w.min(-1, keepdim=True).values.half().float()
            d = ((w.max(-1, keepdim=True).values - low) / 15).half().float()
            lin.weight.data = (d * torch.round((w - low) / d).clamp(0, 15) + low).reshape(lin.weight.shape)
    return model


def random_blocks(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random exact GGUF blocks of an ``[n, k]`` weight: ``(d, low, q4, q8)``, the scales
    ``[n, k / 32, 1]`` and minima (fp16 values), the 4-bit codes ``[n, k / 32, 32]`` (each
    block spanning 0..15) and the 8-bit codes (each block reaching 127). A Q4_1 weight is
    ``d * q4 + low``, a Q8_0 one ``d * q8``."""
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q4 = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q4[..., 0], q4[..., 1] = 0, 15
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q8[..., 0] = 127
    return d, low, q4, q8


def blocks_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
                      bias: torch.Tensor) -> torch.Tensor:
    """The block product's formula one float32 operation at a time (linear.cpp): per block of
    ``L`` inputs (32, or 16 for Q6_K's half-blocks), ``s = fma(x, q, s)`` over its inputs from
    zero, then ``acc = fma(d, s, acc)`` and, with minimums, ``acc = fma(m, xs, acc)`` (``xs``:
    the block's inputs summed in order), the bias added last. ``x [M, K]``, ``q [N, K/L, L]``,
    ``scale``/``low [N, K/L, 1]``. A fused multiply-add is taken in float64, where these
    products are exact, then rounded."""
    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (a.double() * b.double() + c.double()).float()

    rows, blocks, length = x.shape[0], q.shape[1], q.shape[2]
    acc = torch.zeros(rows, q.shape[0])
    for kb in range(blocks):
        s = torch.zeros(rows, q.shape[0])
        xs = torch.zeros(rows)
        for k in range(length):
            column = x[:, kb * length + k]
            s = fma(column[:, None], q[None, :, kb, k], s)
            xs = xs + column
        acc = fma(scale[None, :, kb, 0], s, acc)
        if low is not None:
            acc = fma(low[None, :, kb, 0], xs[:, None], acc)
    return acc + bias


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Hugging Face ``generate(do_sample=False)`` continuation of ``prompt``."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def clone(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(model).to(dtype)


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # A few repeats make prompt lookup find matches.
    out = []
    for n in lengths:
        base = torch.randint(3, VOCAB, (max(1, n // 2),), generator=gen).tolist()
        out.append((base * 3)[:n])
    return out


class RandomTreeDrafter(Drafter):
    """Proposes random trees for tests. Given the reference continuation of each sequence,
    it puts the right token at a random sibling position with probability ``hit``, so
    acceptances happen at every depth and on branches other than the first."""

    kind = DrafterKind.NONE

    def __init__(self, references: list[list[int]], prompt_lengths: list[int], hit: float = 0.7, seed: int = 0):
        self.references = references
        self.prompt_lengths = prompt_lengths
        self.hit = hit
        self.rng = random.Random(seed)

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        trees = []
        for x in inputs:
            done = len(x.context) - self.prompt_lengths[x.index]
            ref = self.references[x.index][done:]
            tokens, parents = [x.context[-1]], [-1]
            frontier = [(0, 0)]  # (node, depth)
            while frontier and len(tokens) < budget.max_nodes:
                node, depth = frontier.pop(0)
                if depth >= budget.max_depth:
                    continue
                width = self.rng.randint(1, 3)
                right = ref[depth] if depth < len(ref) and self.rng.random() < self.hit else None
                slot = self.rng.randrange(width)
                for w in range(width):
                    if len(tokens) >= budget.max_nodes:
                        break
                    tok = right if (w == slot and right is not None) else self.rng.randrange(VOCAB)
                    tokens.append(tok)
                    parents.append(node)
                    frontier.append((len(tokens) - 1, depth + 1))
            trees.append(tree_from_parents(tokens, parents))
        return trees


def char_tokenizer_dir(path: Path) -> None:
    """Save a character-level fast tokenizer with a chat template into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    fast.save_pretrained(path)


def tiny_model_dir(path: Path, arch: str = "llama", max_positions: int = 512, seed: int = 0,
                   **overrides: object) -> Path:
    """A tiny model folder (config, safetensors, tokenizer) usable as ``--model`` (``overrides``
    as :func:`tiny_model` takes them)."""
    model = tiny_model(arch, seed=seed, **overrides)
    if hasattr(model.config, "max_position_embeddings"):
        model.config.max_position_embeddings = max_positions
    model.save_pretrained(path)
    char_tokenizer_dir(path)
    return path
