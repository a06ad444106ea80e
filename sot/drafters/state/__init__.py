"""The state predictor: a small model (one decoder layer by default) that predicts the target's
next hidden states.

Inputs and outputs, for a row at position ``t`` (``D`` = target hidden size, ``S`` = input layers)::

    target states f_t [S, D] (layers low, mid, high)  --fuse-->  s_t [D]
    or, when rolling forward, its own previous output  ------>  s_t [D]
    [state_norm(s_t), embed_norm(E[x_{t+1}])] --inp--> decoder layer(s) (Llama-style, the
    target's width, heads and rope; ``decoder_layers``, default 1) --> g_t [D]: the
    predicted state of position t + 1
    out_norm(g_t) @ H[draft_vocab]^T --> logits [V_d] over x_{t+2}

``E`` and ``H`` are the target's own input embeddings and LM head, shared and frozen; only the
fuse/inp projections, the layer and the norms are trained and saved. ``draft_vocab`` is an
index map onto the target vocabulary (the most frequent tokens), or the whole vocabulary.

With ``arch="eagle3"`` the predictor is EAGLE-3's draft layer instead (no input norms or
``inp`` projection; q/k/v read ``[embedding, state]``; its own ``lm_head``), trained the same
way and written to or read from the folder layout vLLM and SGLang serve by
:mod:`sot.drafters.state.eagle3`; :class:`StatePredictor` gives both data flows.

At inference (:class:`StateDrafter`) the predictor keeps its own KV cache of rows built from
real target states. A tree is grown depth by depth: the ``top_k`` candidates with the highest
cumulative log-probability are expanded, and the best ``predictor_nodes - 1`` nodes overall are
proposed (the free drafts are merged in after, up to ``max_nodes``). Expansion stops early
once no frontier node can still enter the tree.
"""
from sot.drafters.state.config import FORMAT, StatePredictorConfig
from sot.drafters.state.drafter import StateDrafter
from sot.drafters.state.io import (
    check_compatible, grow_predictor, load_predictor, new_predictor, read_predictor_config, save_predictor,
)
from sot.drafters.state.eagle3 import export_eagle3, load_eagle3
from sot.drafters.state.model import DecoderLayer, RMSNorm, StatePredictor
from sot.fingerprint import embedding_hash, target_fingerprint

__all__ = [
    "FORMAT", "DecoderLayer", "RMSNorm", "StateDrafter", "StatePredictor", "StatePredictorConfig", "check_compatible",
    "embedding_hash", "export_eagle3", "grow_predictor", "load_eagle3", "load_predictor", "new_predictor",
    "read_predictor_config", "save_predictor", "target_fingerprint",
]
