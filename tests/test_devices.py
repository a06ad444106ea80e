"""The engine on other devices than the CPU (a CUDA GPU): the losslessness checks of
test_lossless on that device, the state drafter, sampling and the library's ``device``
option; and, everywhere, the errors of a ``--device`` this machine does not have.

The accelerator tests are skipped, with the reason printed, where no GPU is visible; they run
where one is (``pytest tests/test_devices.py`` on a CUDA machine)."""
from __future__ import annotations

import pytest
import torch

from helpers import RandomTreeDrafter, clone, random_prompts, tiny_model, tiny_model_dir
from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.models.loading import resolve_device
from sot.sampling import SamplingMode, SamplingParams

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="no CUDA GPU is visible (these run where one is)"))
NEW = 40
PARAMS = GenerationParams(max_new_tokens=NEW)


def on(model: torch.nn.Module, dtype: torch.dtype, device: str) -> TargetModel:
    return TargetModel(clone(model, dtype).to(device))


def run(target: TargetModel, drafter, prompts, params=PARAMS, trace: bool = False):
    return Engine(target, drafter, TreeBudget(16, 6), trace=trace).generate(prompts, params)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "mistral", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_equals_plain_on_device(device: str, arch: str, dtype: torch.dtype) -> None:
    """Token for token and logits row for logits row, in a batch and alone, on the device;
    prompts long enough that every row has committed keys far behind it."""
    model = tiny_model(arch, seed=3, max_position_embeddings=1024)
    prompts = random_prompts((7, 75, 300), seed=4)
    target = on(model, dtype, device)
    assert target.device.type == device
    plain_alone = [run(target, NoDrafter(), [p], trace=True)[0] for p in prompts]
    tokens = [r.token_ids for r in plain_alone]
    plain_batch = [r.token_ids for r in run(target, NoDrafter(), prompts)]
    assert plain_batch == tokens, "a sequence's output changed with its batch"
    assert [r.token_ids for r in run(target, PromptLookupDrafter(), prompts)] == tokens
    drafter = RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.75, seed=5)
    spec = run(target, drafter, prompts, trace=True)
    assert [r.token_ids for r in spec] == tokens
    assert sum(len(r.token_ids) for r in spec) > sum(r.steps for r in spec), "no draft was accepted"
    for alone, batched in zip(plain_alone, spec):
        a = torch.stack(alone.logit_trace)[: alone.new_tokens]
        b = torch.stack(batched.logit_trace)[: batched.new_tokens]
        assert a.device.type == device and torch.equal(a, b)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 30.0)], ids=["full", "window", "softcap"])
def test_gpu_attention_rows_do_not_depend_on_the_pass(device: str, window: int, softcap: float) -> None:
    """The Triton kernel: each row of a 16-row, 3-sequence pass equals the same row computed
    alone, bit for bit, and matches a plain softmax over the row's keys."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from sot.kernels.triton_attention import tree_attention

    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, slots, rows = 3, 6, 2, 64, 700, 16
    keys, values = (torch.randn(batch, kv_heads, slots, dim, generator=gen).to(device) for _ in range(2))
    query = torch.randn(batch, heads, rows, dim, generator=gen).to(device)
    lengths = [650, 97, 5]
    parents = [-1] + [(i - 1) // 2 for i in range(1, rows)]  # a binary tree
    chains = []
    for i in range(rows):
        chain = []
        while i >= 0:
            chain.append(i)
            i = parents[i]
        chains.append(chain[::-1])
    width = max(len(c) for c in chains)
    table = torch.tensor([[[n + a for a in c] + [-1] * (width - len(c)) for c in chains] for n in lengths],
                         dtype=torch.int32)
    counts = torch.tensor([rows] * batch, dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = tree_attention(query, keys, values, lens.to(device), table.to(device), counts.to(device), 0.125,
                         window, softcap)
    for b in range(batch):
        for r in range(rows):
            alone = tree_attention(query[b:b + 1, :, r:r + 1], keys[b:b + 1], values[b:b + 1], lens[b:b + 1].to(device),
                                   table[b:b + 1, r:r + 1].to(device), torch.ones(1, dtype=torch.int32, device=device),
                                   0.125, window, softcap)
            assert torch.equal(alone[0, 0], out[b, r]), (b, r)
    b, r = 0, rows - 1
    pos = lengths[b] + len(chains[r]) - 1
    slot_list = list(range(lengths[b])) + table[b, r, : len(chains[r])].tolist()
    if window:
        slot_list = slot_list[max(0, pos - window + 1):]
    for h in range(heads):
        scores = keys[b, h // 3, slot_list].float() @ query[b, h, r].float() * 0.125
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        expected = torch.softmax(scores, 0) @ values[b, h // 3, slot_list].float()
        torch.testing.assert_close(out[b, r, h], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_keep_every_bit(device: str, arch: str, dtype: torch.dtype) -> None:
    """Verify passes replayed as CUDA graphs (:mod:`sot.models.graphs`) give the eager passes'
    tokens and logits rows bit for bit, speculative and plain, in a batch and alone; the
    graphs answer most passes and no capture fails."""
    model = clone(tiny_model(arch, seed=3, max_position_embeddings=1024), dtype).to(device)
    prompts = random_prompts((7, 75, 300), seed=4)
    eager = TargetModel(model, cuda_graphs=False)
    assert eager.graphs is None
    plain = [run(eager, NoDrafter(), [p], trace=True)[0] for p in prompts]
    tokens = [r.token_ids for r in plain]
    graphed = TargetModel(model)
    drafter = RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.75, seed=5)
    spec = run(graphed, drafter, prompts, trace=True)
    assert [r.token_ids for r in spec] == tokens
    assert [r.token_ids for r in run(graphed, NoDrafter(), prompts)] == tokens
    for alone, batched in zip(plain, spec):
        a = torch.stack(alone.logit_trace)[: alone.new_tokens]
        b = torch.stack(batched.logit_trace)[: batched.new_tokens]
        assert torch.equal(a, b)
    graphs = graphed.graphs
    assert graphs.failed is None and graphs.replays > NEW, (graphs.failed, graphs.replays)


@pytest.mark.parametrize("device", [CUDA])
def test_state_drafter_on_device(device: str) -> None:
    """The state predictor lives on the target's device and drafts there; output unchanged."""
    from sot.drafters.state import StateDrafter, new_predictor

    model = tiny_model("llama", seed=6).to(device)
    target = TargetModel(model, state_layers=(0, 1, 2))
    pred = new_predictor(model, (0, 1, 2), None, seed=1).to(device)
    drafter = StateDrafter(pred, top_k=3)
    assert drafter.device.type == device
    prompts = random_prompts((20, 90), seed=7)
    plain = [r.token_ids for r in run(target, NoDrafter(), prompts)]
    spec = run(target, drafter, prompts)
    assert [r.token_ids for r in spec] == plain
    assert drafter.passes > 0


@pytest.mark.parametrize("device", [CUDA])
def test_adaptation_on_device(device: str, tiny_run) -> None:
    """Test-time adaptation with the target and predictor on the device: the recorder keeps
    its rows on the host, the learner trains where the predictor lives, output unchanged."""
    from sot.drafters import make_drafter
    from sot.models.loading import load_model
    from sot.online.adapt import AdaptConfig, Adapter
    from state_helpers import LAYERS

    loaded = load_model(str(tiny_run["model_dir"]), device=device)
    target = TargetModel(loaded.model, state_layers=LAYERS)
    drafter = make_drafter("state", loaded.model, tiny_run["predictor"], top_k=3, lookup=False)
    engine = Engine(target, drafter, TreeBudget(13, 4), policy=None)
    adapter = Adapter(engine, AdaptConfig(budget=1.0, lr=3e-3, window=4, rows=64, max_drift=10.0, tolerance=0.99,
                                          first_guess=0.0))
    tok = loaded.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"say {w} please"}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for w in ("red", "blue", "cyan", "green")] * 2
    plain = [r.token_ids for r in run(target, NoDrafter(), prompts)]
    for batch in (1, 3):
        assert [r.token_ids for r in engine.generate(prompts, PARAMS, batch_size=batch)] == plain
    assert adapter.updates > 0, adapter.stats()


@pytest.mark.parametrize("device", [CUDA])
def test_sampling_on_device(device: str) -> None:
    """Seeded coupled sampling equals plain decoding's draws on the device; rejection sampling
    (the request's random stream on the host) and logit rules run there too."""
    model = tiny_model("llama", seed=8)
    target = on(model, torch.float32, device)
    prompts = random_prompts((12, 40), seed=9)
    coupled = GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(
        temperature=0.9, top_p=0.95, seed=11, mode=SamplingMode.COUPLED))
    plain = [r.token_ids for r in run(target, NoDrafter(), prompts, coupled)]
    tokens = [r.token_ids for r in run(target, NoDrafter(), prompts)]
    drafter = RandomTreeDrafter(plain, [len(p) for p in prompts], hit=0.7, seed=2)
    assert [r.token_ids for r in run(target, drafter, prompts, coupled)] == plain
    assert plain != tokens, "sampling drew the greedy answer"
    rejection = GenerationParams(max_new_tokens=NEW, sampling=SamplingParams(
        temperature=0.9, seed=3, mode=SamplingMode.REJECTION, repetition_penalty=1.2, logit_bias=((5, 2.0),)))
    out = run(target, PromptLookupDrafter(), prompts, rejection)
    assert all(len(r.token_ids) == NEW and all(0 <= t < model.config.vocab_size for t in r.token_ids) for r in out)


@pytest.mark.parametrize("device", [CUDA])
def test_library_loads_on_device(device: str, tmp_path) -> None:
    """``SoT.load(device=...)`` puts the target and its cache there; greedy output equals the
    CPU's tokens for this float32 model (a check of the port, not a guarantee across devices:
    the kernels differ)."""
    from sot.api import SoT

    folder = tiny_model_dir(tmp_path / "m")
    gpu = SoT.load(str(folder), drafter="pld", dtype="float32", device=device)
    assert gpu.target.device.type == device
    prompts = ["say red red red red", "blue blue green"]
    answers = gpu.generate(prompts, max_new_tokens=24, chat=False, batch_size=2)
    plain = SoT.load(str(folder), drafter="none", dtype="float32", device=device)
    assert [a.token_ids for a in answers] == [a.token_ids for a in plain.generate(prompts, max_new_tokens=24,
                                                                                  chat=False)]


def test_device_names_are_checked() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="CPU or a CUDA GPU"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
            resolve_device("cuda")
    else:
        with pytest.raises(ConfigError, match="CUDA GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_cli_device_default_is_the_loaders() -> None:
    from sot.cli.common import DEFAULT_DEVICE
    from sot.models.loading import DEFAULT_DEVICE as LOADER_DEFAULT

    assert DEFAULT_DEVICE == LOADER_DEFAULT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cli_refuses_a_missing_gpu(tmp_path) -> None:
    import subprocess
    import sys

    folder = tiny_model_dir(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "sot.cli", "generate", "--model", str(folder), "--device", "cuda",
                           "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA GPU is visible" in proc.stderr and "Traceback" not in proc.stderr
