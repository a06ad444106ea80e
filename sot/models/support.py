"""Which models SoT can decode exactly: the checks that refuse the others by name, before any
weight is used (a GGUF file's are checked from its metadata, before they are converted)."""
from __future__ import annotations

from typing import Any

import torch

#: encoder families that transformers can also load as causal LMs (``BertLMHeadModel``,
#: ``RobertaForCausalLM``, ...): their layers attend both ways, so they are no decoders
ENCODER_FAMILIES = frozenset({
    "albert", "bert", "bert-generation", "camembert", "data2vec-text", "deberta", "deberta-v2", "distilbert",
    "electra", "ernie", "megatron-bert", "modernbert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
    "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
})
#: the layer kinds SoT's attention computes, as configs list them (``layer_types``, ...)
ATTENTION_LAYERS = frozenset({"attention", "full_attention", "sliding_attention"})


#: model types whose layers call the attention interface more than once a pass
TWO_CALL_ATTENTION = frozenset({"diffllama"})


def text_config(config: Any) -> Any:
    """The language model's part of a model's config: the config itself for a text-only model,
    its ``text_config`` for a multimodal one (Gemma 3's 4B-27B checkpoints), which keeps the
    layer count, widths and windows there."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why SoT cannot run ``model`` so that its answers equal transformers' (``None``: it can).

    SoT computes attention itself, through transformers' attention interface, and keeps
    only keys and values between passes. So a model must be a decoder, call attention
    through that interface (not with ALiBi or masks of its own, as Bloom and MPT do), and
    have no layers whose state is not attention's (recurrent or state-space layers)."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; SoT needs a decoder-only causal LM"
    if kind in ENCODER_FAMILIES:
        return f"{kind} is an encoder (its attention is bidirectional); SoT needs a decoder-only causal LM"
    if not getattr(type(model), "_supports_attention_backend", False):
        return ("it computes attention in its own modules (with ALiBi, masks of its own, or no attention at "
                "all), not through the attention interface SoT plugs into")
    text = text_config(config)
    if kind in TWO_CALL_ATTENTION:
        return ("its layers call attention twice a pass (differential attention), and SoT's cache keeps one key "
                "and value per layer")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return "its attention adds learned sink logits (gpt-oss), which SoT's attention does not"
    if getattr(text, "kv_lora_rank", None) or getattr(text, "qk_nope_head_dim", None):
        return ("its multi-head latent attention (DeepSeek V2/V3) has keys and values of other widths than its "
                "heads, which SoT's cache does not hold")
    if getattr(text, "use_bidirectional_attention", None) in (True, "all") or getattr(text, "is_causal", True) is False:
        return ("its attention is bidirectional (an embedding model's setting, use_bidirectional_attention); SoT "
                "needs a causal LM")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # (not a vision tower's layers)
    widths = {(getattr(m, "head_dim", None), m.k_proj.out_features) for m in decoder.modules()
              if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)}
    if len(widths) > 1:
        shown = ", ".join(f"{k // d} key head{'s' if k // d != 1 else ''} of width {d}" if d else f"keys of {k}"
                          for d, k in sorted(widths, key=str))
        return (f"its layers' keys differ in shape ({shown}: Gemma 4's global layers, say), and SoT's cache holds "
                "one shape for every layer")
    for name in ("layer_types", "block_types", "layers_block_type"):
        others = sorted(set(getattr(text, name, None) or ()) - ATTENTION_LAYERS)
        if "chunked_attention" in others:
            return ("its chunked_attention layers (Llama 4's) attend within fixed chunks of positions, a mask SoT's "
                    "attention does not apply")
        if others:
            return f"it has {', '.join(others)} layers, whose state SoT does not carry from pass to pass"
    return None
