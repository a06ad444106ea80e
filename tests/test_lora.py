"""LoRA adapters (``--lora``, ``SoT.load(lora=...)``): merged into the weights at load as
PEFT merges them, so SoT decodes the adapted model, speculative output identical to its
plain decoding and, in float32, to transformers' ``generate`` of PEFT's merged model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import hf_greedy, random_prompts, tiny_model_dir
from sot import SoT
from sot.cli import main
from sot.errors import ConfigError, ModelLoadError
from sot.models.adapter import transformers_attention

NEW = 16


@pytest.fixture(scope="module")
def adapted(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny model folder, a random LoRA adapter for it, and PEFT's merge of the two."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    model_dir = tiny_model_dir(root / "model")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    merged.generation_config.pad_token_id = 0
    return model_dir, root / "adapter", merged


def test_the_adapted_model_is_decoded_exactly(adapted) -> None:
    model_dir, adapter, merged = adapted
    prompts = random_prompts((9, 21), seed=2)
    sot = SoT.load(str(model_dir), drafter="pld", dtype="float32", lora=str(adapter))
    params = sot.params(max_new_tokens=NEW, ignore_eos=True)
    spec = [c.token_ids for c in sot.generate_ids(prompts, params)]
    plain = SoT.load(str(model_dir), drafter="none", dtype="float32", lora=str(adapter))
    assert [c.token_ids for c in plain.generate_ids(prompts, params)] == spec
    assert spec == [hf_greedy(merged, p, NEW) for p in prompts], "differs from transformers on PEFT's merge"
    base = SoT.load(str(model_dir), drafter="none", dtype="float32")
    assert [c.token_ids for c in base.generate_ids(prompts, params)] != spec, "the adapter changed nothing"
    assert sot.name == f"{model_dir.name}+adapter"
    # bfloat16: the merge is made in float32 and cast; speculation still equals plain decoding
    half = [SoT.load(str(model_dir), drafter=d, dtype="bfloat16", lora=str(adapter)) for d in ("pld", "none")]
    assert [c.token_ids for c in half[0].generate_ids(prompts, params)] == \
        [c.token_ids for c in half[1].generate_ids(prompts, params)]


def test_lora_errors_name_the_problem(adapted, tmp_path: Path, capsys) -> None:
    model_dir, adapter, _ = adapted
    with pytest.raises(ConfigError, match="not a LoRA adapter folder"):
        SoT.load(str(model_dir), drafter="none", dtype="float32", lora=str(tmp_path))
    other = tiny_model_dir(tmp_path / "other", arch="gpt2")  # another architecture: no q_proj to adapt
    with pytest.raises(ModelLoadError, match="cannot apply the LoRA adapter"):
        SoT.load(str(other), drafter="none", dtype="float32", lora=str(adapter))
    # an adapter of a deeper model of the same widths: PEFT would merge its first layers alone
    deeper = tiny_model_dir(tmp_path / "deeper", num_hidden_layers=4)
    with pytest.raises(ModelLoadError, match="does not fit this model: .* adapted modules get no weights"):
        SoT.load(str(deeper), drafter="none", dtype="float32", lora=str(adapter))
    with pytest.raises(ConfigError, match="no such folder"):
        SoT.load(str(model_dir), drafter="none", dtype="float32", lora=str(tmp_path / "none"))
    assert main(["generate", "hi", "--model", str(model_dir), "--lora", str(tmp_path / "none")]) == 2
    assert f"--lora {tmp_path / 'none'}: no such folder" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model_dir), "--lora", str(tmp_path)]) == 2
    assert "not a LoRA adapter folder" in capsys.readouterr().err
    assert main(["serve", "--model", str(model_dir), "--lora", str(tmp_path / "none")]) == 2  # before it starts
    assert "no such folder" in capsys.readouterr().err


def test_an_adapter_of_tied_embeddings_changes_only_what_it_adapts(tmp_path: Path) -> None:
    """A LoRA on the embeddings of a model whose output layer shares them (the default
    model's case) changes the embeddings alone, as PEFT applies it: merged into the shared
    matrix it had changed the output layer too (logits off by hundreds)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(tmp_path / "model", tie_word_embeddings=True)
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=["embed_tokens", "q_proj"],
                                                 init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    prompt = random_prompts((12,), seed=3)[0]
    with torch.no_grad():
        want = peft_model(torch.tensor([prompt])).logits[0, -1]
    model = SoT.load(str(model_dir), drafter="none", dtype="float32", lora=str(tmp_path / "adapter")).target.model
    with torch.no_grad(), transformers_attention(model):
        got = model(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    prompt_tuning = tmp_path / "prompt"
    prompt_tuning.mkdir()
    (prompt_tuning / "adapter_config.json").write_text(
        '{"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 4}')
    (prompt_tuning / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="PREFIX_TUNING adapter, which adds virtual tokens"):
        SoT.load(str(model_dir), drafter="none", dtype="float32", lora=str(prompt_tuning))
