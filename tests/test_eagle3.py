"""EAGLE-3 heads: the ``eagle3`` predictor architecture, export to the folder layout vLLM and
SGLang serve, import from it, and lossless drafting with imported heads."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import VOCAB, clone, random_prompts, tiny_model, tiny_model_dir
from state_helpers import LAYERS, ROOT, chain_inputs
from sot.drafters import NoDrafter, TreeBudget, make_drafter
from sot.drafters.base import DraftInput
from sot.drafters.state import StateDrafter, export_eagle3, load_predictor, new_predictor, save_predictor
from sot.drafters.state.io import grow_predictor
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError, DrafterCompatibilityError
from sot.models.adapter import TargetModel
from sot.policy.config import PolicyConfig, PolicyKind

DRAFT = torch.tensor(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:48].tolist()))


#: input layers vLLM and SGLang can serve from a 4-layer target (inputs of layers 1..3)
SERVED = (1, 2, 3)


def _served_target(seed: int) -> torch.nn.Module:
    """A tiny target deep enough for an exportable head: 4 layers, read at :data:`SERVED`."""
    return tiny_model("llama", seed=seed, num_hidden_layers=4)


def _eagle3(model, seed: int = 1, draft: torch.Tensor | None = DRAFT, layers=SERVED):
    """An ``eagle3`` predictor whose every weight is random (norms too), so that no part of
    the layout can go unnoticed."""
    pred = new_predictor(model, layers, draft, seed=seed, arch="eagle3")
    gen = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for name, p in pred.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return pred


def _saved_and_loaded(model, pred, tmp_path: Path):
    """``pred`` through a SoT predictor file (bfloat16, as shipped files are)."""
    save_predictor(pred, tmp_path / "p.safetensors")
    return load_predictor(tmp_path / "p.safetensors", model)


def _trees(pred, seqs, budget=TreeBudget(12, 5)):
    drafter = StateDrafter(pred, top_k=3, lookup=False)
    drafter.reset(len(seqs))
    return drafter.propose([DraftInput(b, ctx, st) for b, (ctx, st) in enumerate(seqs)], budget)


def _same_trees(a, b) -> None:
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.parents == y.parents and x.draft_probs == y.draft_probs


def test_round_trip_on_a_tiny_llama_gives_identical_trees(tmp_path) -> None:
    model = _served_target(seed=4)
    pred = _saved_and_loaded(model, _eagle3(model), tmp_path)
    out = export_eagle3(pred, tmp_path / "head", model)
    back = load_predictor(out, model)
    assert back.config.arch == "eagle3" and back.config.state_layers == SERVED
    assert torch.equal(back.draft_vocab, pred.draft_vocab)
    for (name, a), (_, b) in zip(pred.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    seqs = chain_inputs(model, pred, [9, 20], seed=5)
    trees = _trees(pred, seqs)
    assert any(len(t.tokens) > 1 for t in trees)
    _same_trees(trees, _trees(back, seqs))


def test_round_trip_on_the_default_model_gives_identical_trees(tmp_path) -> None:
    from sot.drafters.state.config import default_state_layers
    from sot.models.loading import load_model

    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    layers = default_state_layers(model.config.num_hidden_layers)
    draft = torch.arange(0, model.config.vocab_size, 3)
    pred = _saved_and_loaded(model, _eagle3(model, draft=draft, layers=layers), tmp_path)
    back = load_predictor(export_eagle3(pred, tmp_path / "head", model), model)
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    states = torch.stack([hidden[i][0] for i in layers], dim=1)  # [T, S, D]
    ctx = ids[0].tolist() + [int(ids[0, -1])]
    seqs = [(ctx, states)]
    trees = _trees(pred, seqs)
    assert len(trees[0].tokens) > 1
    _same_trees(trees, _trees(back, seqs))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_logits(folder: Path, embed: torch.Tensor, states: torch.Tensor, tokens: torch.Tensor):
    """EAGLE-3's draft layer computed from the checkpoint with torch alone: step 1 for every
    row ``t`` (real state ``t``, token ``t + 1``), and step 2 for every row ``t >= 1`` (the
    pre-norm output of row ``t - 1`` fed back in place of ``h``, attending to the real rows
    before ``t`` and to itself). ``states [T, 3, D]``, ``tokens [T]``; returns the target-id
    logits of both steps, ``[T, V_d]`` and ``[T - 1, V_d]``, and the draft->target map."""
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        w = {k: fh.get_tensor(k).float() for k in fh.keys()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = states.shape[0]
    pos = torch.arange(t, dtype=torch.float32)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)  # [T, hd]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # [T, H, hd]
        a, b = x.chunk(2, dim=-1)
        return x * cos[:, None] + torch.cat((-b, a), dim=-1) * sin[:, None]

    def qkv(h):
        e = _rms(embed[tokens], w["midlayer.input_layernorm.weight"], eps)
        x = torch.cat([e, _rms(h, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, hd)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, hd)
        return rope(q), rope(k).repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)

    def rest(h, attn):
        h = h + attn.reshape(t, nh * hd) @ w["midlayer.self_attn.o_proj.weight"].T
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
        return h + mlp @ w["midlayer.mlp.down_proj.weight"].T

    def logits(g):
        return _rms(g, w["norm.weight"], eps) @ w["lm_head.weight"].T

    h1 = states.flatten(1) @ w["fc.weight"].T
    q, k, v = qkv(h1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    g1 = rest(h1, torch.einsum("hts,shd->thd", scores.softmax(-1), v))
    # step 2: row t's input is g1[t - 1]; its keys are the real rows < t and its own
    h2 = torch.cat([torch.zeros_like(g1[:1]), g1[:-1]])
    q2, k2, v2 = qkv(h2)
    real = torch.einsum("thd,shd->hts", q2, k) / math.sqrt(hd)
    real = real.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(-1), float("-inf"))
    own = (q2 * k2).sum(-1).T[:, :, None] / math.sqrt(hd)  # [H, T, 1]
    p = torch.cat([real, own], dim=-1).softmax(-1)
    attn2 = torch.einsum("hts,shd->thd", p[..., :t], v) + p[..., t:].permute(1, 0, 2) * v2
    g2 = rest(h2, attn2)
    draft_to_target = torch.arange(w["d2t"].numel()) + w["d2t"].long()
    return logits(g1), logits(g2)[1:], draft_to_target


def test_an_independent_reference_forward_gives_the_imported_predictors_logits(tmp_path) -> None:
    model = _served_target(seed=6)
    folder = export_eagle3(_saved_and_loaded(model, _eagle3(model, seed=3), tmp_path), tmp_path / "head", model,
                           dtype=torch.float32)
    pred = load_predictor(folder, model)
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(14, 3, 64, generator=gen) * 2
    tokens = torch.randint(0, VOCAB, (14,), generator=gen)
    ref1, ref2, d2t = _reference_logits(folder, model.get_input_embeddings().weight.detach(), states, tokens)
    with torch.no_grad():
        outs = pred.forward_unrolled(states[None], tokens[None], 2)
        ours1, ours2 = pred.logits(outs[0][0]), pred.logits(outs[1][0, 1:])
    assert torch.equal(pred.draft_vocab, d2t)
    assert ref1.abs().max() > 1  # not all near zero
    torch.testing.assert_close(ours1, ref1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours2, ref2, rtol=1e-5, atol=1e-5)


def test_the_exported_key_set_names_shapes_and_dtypes(tmp_path) -> None:
    model = _served_target(seed=4)
    pred = _saved_and_loaded(model, _eagle3(model), tmp_path)
    folder = export_eagle3(pred, tmp_path / "head", model)
    d, inter, nh, nkv, hd = 64, 128, 4, 2, 16
    vd = DRAFT.numel()
    want = {
        "fc.weight": [d, 3 * d],
        "midlayer.input_layernorm.weight": [d], "midlayer.hidden_norm.weight": [d],
        "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * d], "midlayer.self_attn.k_proj.weight": [nkv * hd, 2 * d],
        "midlayer.self_attn.v_proj.weight": [nkv * hd, 2 * d], "midlayer.self_attn.o_proj.weight": [d, nh * hd],
        "midlayer.post_attention_layernorm.weight": [d],
        "midlayer.mlp.gate_proj.weight": [inter, d], "midlayer.mlp.up_proj.weight": [inter, d],
        "midlayer.mlp.down_proj.weight": [d, inter],
        "norm.weight": [d], "lm_head.weight": [vd, d], "d2t": [vd], "t2d": [VOCAB],
    }
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    assert {k: list(v.shape) for k, v in tensors.items()} == want
    assert not any(k.startswith("model.") or "embed_tokens" in k for k in tensors)
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    target_ids = torch.arange(vd) + tensors["d2t"]
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < VOCAB
    assert torch.equal(target_ids, DRAFT) and bool(tensors["t2d"][target_ids].all())
    cfg = json.loads((folder / "config.json").read_text())
    assert int(tensors["t2d"].sum()) == cfg["draft_vocab_size"] == vd
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["target_hidden_size"], cfg["vocab_size"]) == (d, inter, nh, nkv, d, VOCAB)
    assert cfg["max_position_embeddings"] == model.config.max_position_embeddings
    assert cfg["rope_theta"] == pred.config.rope_theta
    # (the eps as written, not float32's long expansion of it: the same float32 value)
    assert cfg["rms_norm_eps"] == float(f"{pred.config.rms_eps:.7g}")
    assert torch.tensor(cfg["rms_norm_eps"]) == torch.tensor(pred.config.rms_eps)
    # vLLM lists the layers whose input is taken, SGLang the layers whose output is, one less
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(SERVED)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in SERVED],
                                   "use_aux_hidden_state": True}


def _random_checkpoint(folder: Path, model, seed: int, draft: torch.Tensor = DRAFT, **config_changes) -> Path:
    """An EAGLE-3 folder written from the layout alone (not by SoT), as a published head."""
    gen = torch.Generator().manual_seed(seed)
    d, inter, nh, nkv, hd = 64, 128, 4, 2, 16
    shapes = {
        "fc.weight": (d, 3 * d), "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * d), "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, nh * hd), "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d), "midlayer.mlp.down_proj.weight": (d, inter),
    }
    tensors = {k: (torch.randn(s, generator=gen) * 0.15).to(torch.bfloat16) for k, s in shapes.items()}
    for k in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
              "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[k] = (1 + 0.2 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    # a head that agrees with the target a good part of the time: its rows, slightly moved
    head = model.get_output_embeddings().weight.detach()[draft]
    tensors["lm_head.weight"] = (head + 0.02 * torch.randn(head.shape, generator=gen)).to(torch.bfloat16)
    tensors["d2t"] = draft - torch.arange(draft.numel())
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft] = True
    tensors["t2d"] = t2d
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "vocab_size": VOCAB, "draft_vocab_size": int(draft.numel()), "target_hidden_size": d,
              "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 0, 1]}}
    config.update(config_changes)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_random_eagle3_checkpoint_drafts_losslessly(tmp_path, dtype: torch.dtype) -> None:
    model = clone(tiny_model("llama", seed=2), dtype)
    folder = _random_checkpoint(tmp_path / "head", model, seed=5)
    drafter = make_drafter("state", model, folder, top_k=3)
    # SGLang's layer ids, one less than the inputs taken: hidden_states 0, 1 and 2
    assert drafter.state_layers == LAYERS and drafter.predictor.config.arch == "eagle3"
    assert drafter.dtype == dtype
    target = TargetModel(model, state_layers=drafter.state_layers)
    prompts = random_prompts((7, 30, 75), seed=3)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    res = Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)
    assert [r.token_ids for r in res] == plain
    alone = [Engine(target, drafter, TreeBudget(16, 6)).generate([p], params)[0].token_ids for p in prompts]
    assert alone == plain
    assert sum(r.steps for r in res) < sum(len(r.token_ids) for r in res), "some drafted tokens are accepted"


def test_a_sharded_head_over_the_whole_vocabulary_without_vocabulary_maps(tmp_path) -> None:
    """Heads published without ``d2t``/``t2d`` (draft vocabulary = the target's) and with their
    weights in shards (``model.safetensors.index.json``) read as the single-file form does."""
    model = tiny_model("llama", seed=2)
    whole = _random_checkpoint(tmp_path / "whole", model, seed=5, draft=torch.arange(VOCAB))
    with safe_open(str(whole / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if k not in ("d2t", "t2d")}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((whole / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(sharded / file))
        weight_map.update({k: file for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_predictor(whole, model), load_predictor(sharded, model)
    assert torch.equal(b.draft_vocab, torch.arange(VOCAB))
    seqs = chain_inputs(model, a, [11, 25], seed=4)
    _same_trees(_trees(a, seqs), _trees(b, seqs))


def test_a_head_for_another_target_is_refused(tmp_path) -> None:
    model = tiny_model("llama", seed=2)
    wide = _random_checkpoint(tmp_path / "wide", model, seed=5, hidden_size=128, target_hidden_size=128)
    with pytest.raises(DrafterCompatibilityError, match="does not fit this target.*hidden_size 128, target 64"):
        load_predictor(wide, model)
    vocab = _random_checkpoint(tmp_path / "vocab", model, seed=5, vocab_size=32000)
    with pytest.raises(DrafterCompatibilityError, match="vocab_size 32000, target 96"):
        load_predictor(vocab, model)
    deep = _random_checkpoint(tmp_path / "deep", model, seed=5, eagle_aux_hidden_state_layer_ids=[2, 16, 29])
    with pytest.raises(DrafterCompatibilityError, match=r"input layers \[2, 16, 29\], target has 2 layers"):
        load_predictor(deep, model)
    for name, changes, message in (
            ("unsorted", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, -1, 0]}}, "ascending order"),
            ("unnormed", {"norm_output": False}, "norm_output false"),
            ("partial", {"intermediate_size": None}, "has a field SoT cannot read"),
            ("no_heads", {"num_attention_heads": "four"}, "has a field SoT cannot read")):
        bad = _random_checkpoint(tmp_path / name, model, seed=5, **changes)
        with pytest.raises(DrafterCompatibilityError, match=message):
            load_predictor(bad, model)
    floaty = _random_checkpoint(tmp_path / "floaty", model, seed=5)
    with safe_open(str(floaty / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    save_file({**tensors, "d2t": tensors["d2t"].float()}, str(floaty / "model.safetensors"))
    with pytest.raises(DrafterCompatibilityError, match="d2t is torch.float32"):
        load_predictor(floaty, model)
    scaled = _random_checkpoint(tmp_path / "scaled", model, seed=5, rope_theta=None,  # (transformers 5's layout)
                                rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0})
    with pytest.raises(DrafterCompatibilityError, match="rope_scaling .*llama3"):
        load_predictor(scaled, model)
    based = _random_checkpoint(tmp_path / "based", model, seed=5, rope_theta=None,
                               rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    assert load_predictor(based, model).config.rope_theta == 500000.0
    not_eagle = tmp_path / "llama"
    model.save_pretrained(not_eagle)
    with pytest.raises(DrafterCompatibilityError, match="not LlamaForCausalLMEagle3"):
        load_predictor(not_eagle, model)
    model_dir = tiny_model_dir(tmp_path / "model")
    proc = subprocess.run([sys.executable, "-m", "sot.cli", "generate", "hello", "--model", str(model_dir),
                           "--drafter", "state", "--predictor", str(wide), "--max-new-tokens", "4"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not fit this target" in proc.stderr


def _rewrite(folder: Path, **changes: torch.Tensor | None) -> Path:
    """``folder``'s weights with tensors replaced, added, or (``None``) removed."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    for name, value in changes.items():
        if value is None:
            tensors.pop(name.replace("__", "."))
        else:
            tensors[name.replace("__", ".")] = value
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_published_heads_are_read_as_the_engines_read_them_or_refused_by_name(tmp_path) -> None:
    """What vLLM and SGLang accept loads (a head over the whole vocabulary without its own
    ``lm_head``; embeddings of its own, with a warning that SoT drafts with the target's); a
    head they would run otherwise, or whose vocabulary maps contradict each other, is refused
    with the field named, before any draft."""
    model = tiny_model("llama", seed=2)
    whole = _rewrite(_random_checkpoint(tmp_path / "whole", model, seed=5, draft=torch.arange(VOCAB)),
                     lm_head__weight=None)
    shared = load_predictor(whole, model)
    assert torch.equal(shared.lm_head.weight, model.get_output_embeddings().weight.float())
    part = _rewrite(_random_checkpoint(tmp_path / "part", model, seed=5), lm_head__weight=None)
    with pytest.raises(DrafterCompatibilityError, match="needs its own lm_head.weight"):
        load_predictor(part, model)
    embed = model.get_input_embeddings().weight.detach()
    same = _rewrite(_random_checkpoint(tmp_path / "same_embed", model, seed=5), embed_tokens__weight=embed.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_predictor(same, model)
    other = _rewrite(_random_checkpoint(tmp_path / "own_embed", model, seed=5), embed_tokens__weight=embed + 1)
    with pytest.warns(UserWarning, match="own embed_tokens.*drafts with the target's embeddings"):
        load_predictor(other, model)
    ids = DRAFT.clone()
    for name, tensors, changes, message in (
            ("target_ids", {"d2t": ids}, {}, "d2t and t2d disagree"),
            ("twice", {"d2t": torch.cat([ids[:1], ids[:-1]]) - torch.arange(ids.numel()), "t2d": None}, {},
             "two draft ids onto the same target token"),
            ("flat", {"d2t": (ids - torch.arange(ids.numel())).reshape(6, 8)}, {}, r"shape \(6, 8\)"),
            ("unsized", {}, {"draft_vocab_size": None}, "d2t has 48 entries, but config.json has no draft_vocab_size"),
            ("kv", {}, {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
            ("gelu", {}, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
            ("biased", {}, {"attention_bias": True}, "attention_bias true"),
            ("unnamed", {}, {"eagle_config": {}}, "EAGLE-3's default for a 2-layer target")):
        folder = _rewrite(_random_checkpoint(tmp_path / name, model, seed=5, **changes), **tensors)
        with pytest.raises(DrafterCompatibilityError, match=message):
            load_predictor(folder, model)


def test_training_from_a_published_head_keeps_its_settings(tmp_path) -> None:
    """``--init-from`` a head whose norm epsilon, rope base and residual differ from what SoT
    would choose for the target starts training from that head, not from a reshaped one."""
    model = tiny_model("llama", seed=2)
    folder = _random_checkpoint(tmp_path / "head", model, seed=5, rms_norm_eps=1e-2, rope_theta=50.0,
                                norm_before_residual=True)
    start = load_predictor(folder, model)
    grown, added = grow_predictor(folder, model, start.config.state_layers, 1)
    assert not added
    for field in ("num_heads", "num_kv_heads", "head_dim", "rms_eps", "rope_theta", "norm_before_residual"):
        assert getattr(grown.config, field) == getattr(start.config, field), field
    seqs = chain_inputs(model, start, [11, 25], seed=4)
    _same_trees(_trees(start, seqs), _trees(grown, seqs))


def test_native_predictors_are_not_exported_and_eagle3_keeps_one_layer(tmp_path) -> None:
    model = tiny_model("llama", seed=4)
    with pytest.raises(ConfigError, match="native SoT predictor.*--arch eagle3"):
        export_eagle3(new_predictor(model, LAYERS, None, seed=1), tmp_path / "x", model)
    # vLLM and SGLang capture each input layer once, ascending, from the inputs of layers 1..L-1
    deep = _served_target(seed=4)
    for layers, message in (((3, 1, 2), "distinct and ascending"), ((1, 1, 3), "distinct and ascending"),
                            ((0, 1, 2), r"in 1\.\.3 for a 4-layer target"), ((1, 2, 4), r"in 1\.\.3"),
                            ((1, 2), "three input layers")):
        with pytest.raises(ConfigError, match=message):
            export_eagle3(_eagle3(deep, layers=layers), tmp_path / "y", deep)
    assert not (tmp_path / "y").exists()
    # an export never writes over a model or other files, but replaces an earlier export
    model_dir = tiny_model_dir(tmp_path / "model")
    with pytest.raises(ConfigError, match="give a new or empty folder"):
        export_eagle3(_eagle3(deep), model_dir, deep)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    with pytest.raises(ConfigError, match="holds README.md"):
        export_eagle3(_eagle3(deep), tmp_path / "notes", deep)
    again = export_eagle3(_eagle3(deep, seed=2), export_eagle3(_eagle3(deep), tmp_path / "head", deep), deep)
    assert (again / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by a server's user
    with pytest.raises(ConfigError, match="one decoder layer"):
        new_predictor(model, LAYERS, None, decoder_layers=2, arch="eagle3")
    with pytest.raises(ConfigError, match="own draft vocabulary"):
        new_predictor(model, LAYERS, DRAFT, arch="eagle3").use_full_vocabulary(model.get_output_embeddings().weight)


def test_train_an_eagle3_head_export_it_and_draft_with_the_export(tiny_run, tmp_path) -> None:
    """``sot train fit --arch eagle3`` learns, ``sot export`` writes the folder, and the folder
    drafts through ``--predictor`` as losslessly as the file, accepting drafts."""
    from dataclasses import replace

    from sot.models.loading import load_model
    from sot.train.data import build_state_cache
    from sot.train.trainer import fit
    from state_helpers import conversations

    # the tiny run's settings on a target deep enough for the engines to serve the head (4 layers)
    model_dir = tiny_model_dir(tmp_path / "model", num_hidden_layers=4)
    loaded = load_model(str(model_dir))
    for split, n in (("train", 40), ("eval", 6)):
        build_state_cache(loaded.model, loaded.tokenizer, conversations(n), tmp_path / "data" / split, SERVED, None,
                          256, progress=False)
    run = tmp_path / "run"
    cfg = replace(tiny_run["cfg"], model=str(model_dir), data=str(tmp_path / "data"))
    predictor = fit(replace(cfg, out=str(run), arch="eagle3", steps=30))
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    losses = [h["loss"] for h in state["history"]]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), "training lowers the loss"
    assert state["evals"][-1]["chain_tau"] > state["evals"][0]["chain_tau"], "and raises the held-out acceptance"
    out = tmp_path / "head"
    proc = subprocess.run([sys.executable, "-m", "sot.cli", "export", "--format", "eagle3", str(predictor), str(out),
                           "--model", str(model_dir), "--dtype", "float32"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert fh.get_tensor("fc.weight").dtype == torch.float32
    assert "SGLang counts them as [0, 1, 2]" in proc.stderr
    native = subprocess.run([sys.executable, "-m", "sot.cli", "export", str(tiny_run["predictor"]), str(tmp_path / "n"),
                             "--model", str(tiny_run["model_dir"])], capture_output=True, text=True, cwd=ROOT)
    assert native.returncode == 2 and "native SoT predictor" in native.stderr and "Traceback" not in native.stderr
    missing = subprocess.run([sys.executable, "-m", "sot.cli", "export", str(tmp_path / "no.safetensors"),
                              str(tmp_path / "m"), "--model", "/no/such/model"],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and "no.safetensors does not exist" in missing.stderr  # before the model loads
    tok = loaded.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"say {w} please"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for w in ("red", "blue", "cyan")]
    params = GenerationParams(max_new_tokens=40)
    target = TargetModel(loaded.model, state_layers=SERVED)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    static = PolicyConfig(kind=PolicyKind.STATIC)  # draft every step: the tiny target's verify is too cheap to pay
    for source in (predictor, out):
        drafter = make_drafter("state", loaded.model, source, top_k=4, lookup=False)
        res = Engine(target, drafter, TreeBudget(12, 6), policy=static).generate(prompts, params)
        assert [r.token_ids for r in res] == plain
        assert sum(sum(r.accept_lengths) - r.steps for r in res) > 0, f"{source} drafts are accepted"
    # an EAGLE-3 folder (here the export; as well one trained elsewhere) is fine-tuned in SoT
    again = fit(replace(cfg, out=str(tmp_path / "again"), arch="eagle3", init_from=str(out), steps=3, eval_every=3))
    assert load_predictor(again, loaded.model).config.arch == "eagle3"
    with pytest.raises(ConfigError, match="architecture eagle3; continue it with --arch eagle3"):
        fit(replace(cfg, out=str(tmp_path / "wrong"), init_from=str(out), steps=3))


def test_default_input_layers_are_three_distinct_inner_layers_from_four_layers_on() -> None:
    """The layers an EAGLE-3 head reads by default are what export accepts: three distinct,
    ascending, past the embeddings and before the last layer's output (2, L/2, L-3 where those
    are three: the 30-layer default model's 2, 15, 27)."""
    from sot.drafters.state.config import default_state_layers

    assert default_state_layers(30) == (2, 15, 27)
    for n in range(4, 64):
        low, mid, high = default_state_layers(n)
        assert 1 <= low < mid < high < n, (n, (low, mid, high))
