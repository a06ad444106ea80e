"""``sot train onpolicy``: train the state predictor on its own drafts.

Each iteration decodes a share of the training prompts with the engine and the current
predictor (batched; greedy and sampled; the predictor drafts every step, a fixed beam), and
:class:`~sot.online.record.NodeRecorder` keeps what every verify pass computed along the
committed path, plus where each drafted chain started and where it was first rejected. Then
the predictor takes ``steps_per_iteration`` optimiser steps of the on-policy loss
(:mod:`sot.online.loss`) on the replay buffer: the ``fit`` loss unrolled on the predictor's own
states, against the target's recorded distributions and states, weighted towards the rows the
engine's chains actually visited and the rows where they went wrong. The next iteration
decodes with the improved predictor.

The buffer is sharded (one safetensors file per decoded batch) and bounded: the oldest shards
go when it passes ``buffer_gb``. A checkpoint after every decode phase and every
``save_every`` steps makes the run resumable; ``report.json`` records the seconds spent
decoding and training, so that runs can be compared at equal compute.
"""
from __future__ import annotations

import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sot.errors import ConfigError
from sot.models.support import text_config
from sot.online.loss import OnlineLossConfig, online_loss
from sot.online.record import DEFAULT_TOP_K, NodeRecorder, OnPolicySequence
from sot.train import check_run_folder
from sot.train.trainer import Diverged, terminate_as_interrupt, warmup_cosine


@dataclass
class OnPolicyConfig:
    """Everything an ``onpolicy`` run needs; saved as ``config.json`` in the run folder."""

    model: str = "default"
    #: the predictor to start from (default: the one shipped for the default model)
    init_from: str = ""
    out: str = ""
    iterations: int = 4
    prompts_per_iteration: int = 32
    #: share of the prompts that are coding requests (the rest: ShareGPT training prompts)
    code_share: float = 0.5
    #: a JSONL file of prompts to use instead (records with 'id' and 'prompt', or ShareGPT
    #: 'conversations', as ``gen-data --prompts`` reads); taken in order, cycled if short
    prompts_file: str = ""
    batch_size: int = 8
    max_new_tokens: int = 192
    #: temperatures the decode batches take in turn (0: greedy; others: sampled)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    steps_per_iteration: int = 30
    tokens_per_step: int = 2048
    lr: float = 3e-4
    warmup: int = 10
    grad_clip: float = 1.0
    top_k: int = DEFAULT_TOP_K
    buffer_gb: float = 2.0
    save_every: int = 10
    seed: int = 0
    dtype: str = "auto"
    #: stop (with a checkpoint) once this many seconds of decoding and training are spent (0: never)
    max_seconds: float = 0.0
    loss: OnlineLossConfig = field(default_factory=OnlineLossConfig)


def _check(cfg: OnPolicyConfig) -> None:
    if not cfg.out:
        raise ConfigError("onpolicy needs --out, the run folder")
    if cfg.iterations < 1 or cfg.prompts_per_iteration < 1 or cfg.steps_per_iteration < 0:
        raise ConfigError("--iterations and --prompts-per-iteration must be >= 1, --steps-per-iteration >= 0")
    if not 0.0 <= cfg.code_share <= 1.0:
        raise ConfigError(f"--code-share is a fraction in [0, 1], got {cfg.code_share}")
    if not cfg.temperatures:
        raise ConfigError("--temperatures needs at least one temperature")
    if any(t < 0 for t in cfg.temperatures):
        raise ConfigError(f"--temperatures must each be >= 0, got {list(cfg.temperatures)}")
    if cfg.buffer_gb <= 0:
        raise ConfigError(f"--buffer-gb must be > 0, got {cfg.buffer_gb}")
    if not (math.isfinite(cfg.max_seconds) and cfg.max_seconds >= 0):
        raise ConfigError(f"--max-seconds must be >= 0 (0: no limit), got {cfg.max_seconds}")
    if not all(math.isfinite(t) for t in cfg.temperatures):
        raise ConfigError(f"--temperatures must be finite numbers, got {list(cfg.temperatures)}")
    loss = cfg.loss
    if not all(math.isfinite(v) and v >= 0 for v in (loss.uniform, loss.error_weight)):
        raise ConfigError("--uniform and --error-weight must be finite numbers >= 0")


#: what a resumed run must share with the run that wrote its checkpoint (the rest may change)
_SAME_ON_RESUME = ("model", "init_from", "dtype", "seed")


# ---------------------------------------------------------------------------- the buffer
def write_shard(path: Path, seqs: list[OnPolicySequence]) -> None:
    """Write recorded sequences to one safetensors file (concatenated, with offsets)."""
    if not seqs:
        return
    has_final = all(s.final is not None for s in seqs)
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]),
        "states": torch.cat([s.states for s in seqs]).contiguous(),
        "top_ids": torch.cat([s.top_ids for s in seqs]),
        "top_logp": torch.cat([s.top_logp for s in seqs]),
        "chains": torch.cat([s.chains for s in seqs]),
    }
    if has_final:
        tensors["final"] = torch.cat([s.final for s in seqs]).contiguous()
    meta = {"lengths": [s.length for s in seqs], "chains": [int(s.chains.shape[0]) for s in seqs],
            "prompt_lens": [s.prompt_len for s in seqs], "temperatures": [s.temperature for s in seqs]}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"sot": json.dumps(meta)})
    tmp.replace(path)


def shard_size(path: Path) -> int:
    """How many sequences a shard holds (its metadata only)."""
    with safe_open(str(path), framework="pt") as fh:
        return len(json.loads(fh.metadata()["sot"])["lengths"])


def read_shard(path: Path) -> list[OnPolicySequence]:
    """The sequences of a shard written by :func:`write_shard`."""
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["sot"])
        t = {k: fh.get_tensor(k) for k in fh.keys()}
    out, at, ct = [], 0, 0
    for n, c, p, temp in zip(meta["lengths"], meta["chains"], meta["prompt_lens"], meta["temperatures"]):
        out.append(OnPolicySequence(t["tokens"][at : at + n], t["states"][at : at + n],
                                    t["final"][at : at + n] if "final" in t else None, t["top_ids"][at : at + n],
                                    t["top_logp"][at : at + n], p, t["chains"][ct : ct + c], temp))
        at, ct = at + n, ct + c
    return out


class ReplayBuffer:
    """The recorded sequences of a run: shards in ``folder``, oldest dropped past ``max_bytes``."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        for stray in folder.glob("*.tmp"):
            stray.unlink()
        self.items: list[OnPolicySequence] = [s for f in self.shards() for s in read_shard(f)]

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.safetensors"))

    def add(self, name: str, seqs: list[OnPolicySequence]) -> None:
        write_shard(self.folder / f"shard-{name}.safetensors", seqs)
        self.items += seqs
        files = self.shards()
        while len(files) > 1 and sum(f.stat().st_size for f in files) > self.max_bytes:
            gone = shard_size(files[0])
            files[0].unlink()
            files = files[1:]
            self.items = self.items[gone:]

    def drop(self, prefix: str) -> None:
        """Remove the shards whose names start with ``prefix`` (an interrupted decode phase)."""
        for f in self.folder.glob(f"shard-{prefix}*.safetensors"):
            f.unlink()
        self.items = [s for f in self.shards() for s in read_shard(f)]

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.items)


# ---------------------------------------------------------------------------- prompts
def onpolicy_prompts(cfg: OnPolicyConfig) -> list[str]:
    """Every iteration's prompts, in order: ShareGPT training first turns and standard-library
    coding requests, interleaved by ``code_share``."""
    from sot.train.acceptance import code_training_prompts, training_prompts

    total = cfg.iterations * cfg.prompts_per_iteration
    if cfg.prompts_file:
        from sot.train.selfdistill import read_prompts

        texts = [text for _, text in read_prompts(cfg.prompts_file)]
        if not texts:
            raise ConfigError(f"{cfg.prompts_file} holds no prompts")
        return [texts[i % len(texts)] for i in range(total)]
    n_code = round(total * cfg.code_share)
    chat, code = training_prompts(total - n_code), code_training_prompts(n_code, cfg.seed)
    out, ci, ki = [], 0, 0
    for i in range(total):  # spread the code prompts evenly
        want_code = ki < len(code) and (ci >= len(chat) or (ki + 1) / (i + 1) <= cfg.code_share + 1e-9)
        if want_code:
            out.append(code[ki])
            ki += 1
        elif ci < len(chat):
            out.append(chat[ci])
            ci += 1
    return out


# ---------------------------------------------------------------------------- the run
def _decode(loaded, target, predictor_file: Path, prompts: list[str], temperature: float, cfg: OnPolicyConfig,
            seed: int) -> list[OnPolicySequence]:
    """Decode ``prompts`` with the predictor drafting every step; the recorded sequences."""
    from sot.drafters import make_drafter
    from sot.drafters.base import TreeBudget
    from sot.engine import Engine
    from sot.policy import PolicyConfig, PolicyKind
    from sot.prompts import encode
    from sot.requests import GenerationParams
    from sot.sampling import SamplingParams

    model, tok = loaded.model, loaded.tokenizer
    drafter = make_drafter("state", model, str(predictor_file), lookup=False)
    rec = NodeRecorder(len(drafter.state_layers), cfg.top_k)
    engine = Engine(target, drafter, TreeBudget(), policy=PolicyConfig(kind=PolicyKind.STATIC), observers=[rec])
    eos = tok.eos_token_id
    params = GenerationParams(max_new_tokens=cfg.max_new_tokens, sampling=SamplingParams(temperature=temperature,
                                                                                          seed=seed),
                              eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()))
    ids = [encode(tok, {"turns": [p]}, True) for p in prompts]
    room = target.max_positions
    fits = [x for x in ids if room is None or len(x) + cfg.max_new_tokens <= room]
    if len(fits) < len(ids):  # (one long prompt must not end a run of hours)
        from tqdm import tqdm

        tqdm.write(f"skipped {len(ids) - len(fits)} prompt(s) too long for the model's context of {room} tokens "
                   f"with --max-new-tokens {cfg.max_new_tokens}")
    if fits:
        engine.generate(fits, params, cfg.batch_size)
    return rec.take()


def _draw(buffer: ReplayBuffer, tokens: int, rng: random.Random) -> list[OnPolicySequence]:
    batch, n = [], 0
    while n < tokens and buffer.items:
        item = buffer.items[rng.randrange(len(buffer.items))]
        batch.append(item)
        n += item.length
    return batch


def train_onpolicy(cfg: OnPolicyConfig) -> Path:
    """Run (or resume) an on-policy stage; returns the final predictor file."""
    from tqdm import tqdm

    from sot.drafters import DEFAULT_PREDICTOR
    from sot.drafters.state import load_predictor, save_predictor
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model, resolve_dtype

    _check(cfg)
    prompts = onpolicy_prompts(cfg)  # (bad prompts stop the run before the model loads and --out is written)
    out = Path(cfg.out)
    start_file = Path(cfg.init_from) if cfg.init_from else DEFAULT_PREDICTOR
    if not start_file.is_file():
        raise ConfigError(f"predictor file {start_file} not found")
    ckpt = out / "checkpoint.pt"
    check_run_folder(out, {"iterations", "prompts_per_iteration", "out"}, "onpolicy")
    saved = _read_checkpoint(ckpt, cfg) if ckpt.is_file() else None
    loaded = load_model(cfg.model, dtype=resolve_dtype(cfg.dtype))
    # the trained copy reads float32 embeddings; the decoding target keeps its own dtype
    pred = load_predictor(start_file, loaded.model, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)  # (written once the settings, the model and the start hold)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    for p in pred.parameters():
        p.requires_grad_(True)
    pred.head = pred.head.float()
    layers = tuple(pred.config.state_layers)
    final_layer = text_config(loaded.model.config).num_hidden_layers
    target = TargetModel(loaded.model, state_layers=layers + ((final_layer,) if final_layer not in layers else ()))
    opt = torch.optim.AdamW(pred.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = cfg.iterations * cfg.steps_per_iteration

    def lr_at(step: int) -> float:
        return warmup_cosine(step, cfg.lr, cfg.warmup, total_steps)

    state = {"iteration": 0, "decoded": False, "step": 0, "history": [], "decode_seconds": 0.0,
             "train_seconds": 0.0, "phases": []}
    rng = random.Random(cfg.seed)  # the batches drawn from the buffer
    torch.manual_seed(cfg.seed)  # the state noise of the loss
    if saved is not None:
        pred.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        if "rng" in saved:  # (so a resumed run draws what an unbroken one would)
            rng.setstate(saved["rng"])
            torch.set_rng_state(saved["torch_rng"])
        tqdm.write(f"resuming {out} at iteration {state['iteration']}, step {state['step']}")
    buffer = ReplayBuffer(out / "buffer", int(cfg.buffer_gb * 2**30))
    current = out / "predictor.safetensors"
    # the random states when the decode phase under way began: a phase stopped midway is
    # decoded again from its start on resuming, so that is the state to resume from
    phase_rng: dict[str, tuple] = {}

    def save() -> None:
        save_predictor(pred, current)
        tmp = out / "checkpoint.pt.tmp"
        draws, noise = phase_rng.get("start") or (rng.getstate(), torch.get_rng_state())
        torch.save({"model": pred.state_dict(), "optimizer": opt.state_dict(), "state": state,
                    "config": asdict(cfg), "rng": draws, "torch_rng": noise}, tmp)
        tmp.replace(ckpt)
        (out / "report.json").write_text(json.dumps(_report(state, buffer), indent=2))

    if not current.is_file():
        save()
    device = torch.device("cpu")
    done = (state["iteration"] * (cfg.prompts_per_iteration + cfg.steps_per_iteration)
            + (cfg.prompts_per_iteration if state["decoded"] else 0)
            + state["step"] - state["iteration"] * cfg.steps_per_iteration)
    bar = tqdm(total=cfg.iterations * (cfg.prompts_per_iteration + cfg.steps_per_iteration), initial=done,
               desc="onpolicy", unit="item", dynamic_ncols=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate_as_interrupt) if main else None
    try:
        _run(cfg, state, pred, opt, lr_at, buffer, prompts, rng, device, bar, save, loaded, target, current, out,
             phase_rng)
    except KeyboardInterrupt:  # (Ctrl-C, or SIGTERM): keep the training steps done since the last save
        save()
        tqdm.write(f"interrupted: {out} saved at iteration {state['iteration']}, step {state['step']}; the same "
                   "command resumes it", file=sys.stderr)
        raise
    finally:
        bar.close()  # (a stopped run's bar ends its line too)
        if main:
            signal.signal(signal.SIGTERM, previous)
    save()
    return current


def _read_checkpoint(ckpt: Path, cfg: OnPolicyConfig) -> dict:
    """The checkpoint of an earlier run in the same folder, refused when it was made for another
    model, start or seed (its weights would be kept under the new settings' name)."""
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a damaged file
        raise ConfigError(f"{ckpt} cannot be read ({type(exc).__name__}); remove it to start over") from None
    earlier = saved.get("config") or {}
    if "state" not in saved or "iterations" not in earlier:
        raise ConfigError(f"{ckpt.parent} holds a run of another stage (fit?); give onpolicy's --out a new folder "
                          "(--init-from takes that run's predictor file)")
    now = asdict(cfg)
    changed = [k for k in _SAME_ON_RESUME if k in earlier and earlier[k] != now[k]]
    if changed:
        shown = ", ".join(f"{k} {earlier[k]!r} (now {now[k]!r})" for k in changed)
        raise ConfigError(f"{ckpt.parent} holds a run made with {shown}; give --out a new folder, or the same "
                          "settings to resume it")
    return saved


def _run(cfg: OnPolicyConfig, state: dict, pred, opt, lr_at, buffer, prompts, rng: random.Random, device,
         bar, save, loaded, target, current: Path, out: Path, phase_rng: dict[str, tuple]) -> None:
    """The iterations from ``state`` on: decode a batch of prompts with the current predictor,
    then train on the buffer. ``phase_rng["start"]`` holds the random states while a decode
    phase is under way (what ``save`` keeps then)."""
    from tqdm import tqdm

    from sot.drafters.state import save_predictor

    while state["iteration"] < cfg.iterations:
        it = state["iteration"]
        if not state["decoded"]:
            phase_rng["start"] = (rng.getstate(), torch.get_rng_state())
            buffer.drop(f"{it:03d}-")  # what an interrupted decode phase left
            mine = prompts[it * cfg.prompts_per_iteration : (it + 1) * cfg.prompts_per_iteration]
            t0 = time.perf_counter()
            recorded: list[OnPolicySequence] = []
            for j in range(0, len(mine), cfg.batch_size):
                temp = cfg.temperatures[(j // cfg.batch_size + it) % len(cfg.temperatures)]
                seqs = _decode(loaded, target, current, mine[j : j + cfg.batch_size], temp, cfg,
                               cfg.seed + 1000 * it + j)
                buffer.add(f"{it:03d}-{j:05d}", seqs)
                recorded += seqs
                bar.update(len(mine[j : j + cfg.batch_size]))
            if not buffer.items:  # (every prompt was skipped: steps would train on nothing)
                raise ConfigError(f"iteration {it}: no recorded sequence to train on; every prompt was too long "
                                  f"for the model's context with --max-new-tokens {cfg.max_new_tokens}")
            seconds = time.perf_counter() - t0
            state["decode_seconds"] += seconds
            state["decoded"] = True
            phase_rng.clear()
            state["phases"].append({"iteration": it, "decode_seconds": round(seconds, 2),
                                    "mean_accepted": _mean_accepted(recorded)})
            tqdm.write(f"iteration {it}: decoded {len(mine)} prompts in {seconds:.0f}s, mean accepted length "
                       f"{state['phases'][-1]['mean_accepted']:.3f} per drafted step")
            save()
        pred.train()
        while state["step"] < (it + 1) * cfg.steps_per_iteration:
            if _out_of_time(cfg, state):
                break
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(state["step"])
            opt.zero_grad(set_to_none=True)
            batch = _draw(buffer, cfg.tokens_per_step, rng)
            ntok = sum(s.length for s in batch)
            agg: dict[str, float] = {}
            for seq in batch:
                loss, parts = online_loss(pred, pred, seq, cfg.loss, device)
                (loss * seq.length / ntok).backward()
                for key, val in parts.items():
                    agg[key] = agg.get(key, 0.0) + val * seq.length / ntok
            if not all(math.isfinite(v) for v in agg.values()):  # keep the last checkpoint, not these weights
                raise Diverged(f"the loss is not a finite number at step {state['step'] + 1} ({agg.get('loss')}): "
                               f"the run diverged; {out} keeps its last checkpoint (a lower --lr may fit)")
            torch.nn.utils.clip_grad_norm_(pred.parameters(), cfg.grad_clip)
            opt.step()
            state["step"] += 1
            state["train_seconds"] += time.perf_counter() - t0
            agg.update(step=state["step"], tokens=ntok,
                       seconds=round(state["decode_seconds"] + state["train_seconds"], 2))
            state["history"].append(agg)
            bar.update(1)
            bar.set_postfix(loss=f"{agg.get('loss', 0):.3f}", acc0=f"{agg.get('acc0', 0):.2f}")
            if state["step"] % cfg.save_every == 0:
                save()
        if _out_of_time(cfg, state):
            save()
            tqdm.write(f"stopping after {state['decode_seconds'] + state['train_seconds']:.0f}s (--max-seconds)")
            break
        state["iteration"] += 1
        state["decoded"] = False
        save()
        save_predictor(pred, out / f"predictor-it{it}.safetensors")


def _out_of_time(cfg: OnPolicyConfig, state: dict) -> bool:
    return bool(cfg.max_seconds) and state["decode_seconds"] + state["train_seconds"] >= cfg.max_seconds


def _mean_accepted(seqs: list[OnPolicySequence]) -> float:
    chains = [s.chains for s in seqs if s.chains.shape[0]]
    if not chains:
        return 0.0
    return float(torch.cat(chains)[:, 1].float().mean())


def _report(state: dict, buffer: ReplayBuffer) -> dict:
    return {"iterations_done": state["iteration"], "steps": state["step"],
            "decode_seconds": round(state["decode_seconds"], 2), "train_seconds": round(state["train_seconds"], 2),
            "phases": state["phases"], "buffer_sequences": len(buffer.items), "buffer_tokens": buffer.tokens,
            "buffer_bytes": sum(f.stat().st_size for f in buffer.shards()),
            "last": state["history"][-1] if state["history"] else {}}
