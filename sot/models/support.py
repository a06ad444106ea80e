"""Which models SoT can decode exactly: the checks that refuse the others by name, before any
weight is used (a GGUF file's are checked from its metadata, before they are converted)."""
from __future__ import annotations

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
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if kind in TWO_CALL_ATTENTION:
        return ("its layers call attention twice a pass (differential attention), and SoT's cache keeps one key "
                "and value per layer")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return "its attention adds learned sink logits (gpt-oss), which SoT's attention does not"
    if getattr(text, "kv_lora_rank", None) or getattr(text, "qk_nope_head_dim", None):
        return ("its multi-head latent attention (DeepSeek V2/V3) has keys and values of other widths than its "
                "heads, which SoT's cache does not hold")
    for name in ("layer_types", "block_types", "layers_block_type"):
        others = sorted(set(getattr(text, name, None) or ()) - ATTENTION_LAYERS)
        if others:
            return f"it has {', '.join(others)} layers, whose state SoT does not carry from pass to pass"
    return None
