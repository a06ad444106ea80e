"""The state-predictor trainer: multi-step (training-time test) loss on cached target states.

Per sequence (``T`` tokens, cached states ``[T, S + 1, D]``: ``S`` input layers, then the
target's final normed hidden state ``h``)::

    rows t = 0..T-2: input states f_t, next token x_{t+1}; target: h_{t+1} and
    p_{t+1} = softmax(h_{t+1} @ H_d^T), the target's next-token distribution on the draft vocab
    for k in 0..K-1 (unrolled on the predictor's own states, weight w_k = decay^k):
        loss_k = CE(p_{t+1}, q_k) + state_weight * smoothL1(out_norm(g_k), h_{t+1})
    + stability_weight * |out_norm(g_0(f + delta)) - out_norm(g_0(f))|^2 / perturb^2
    (the input states also carry Gaussian noise: ``state_noise``)

Only rows inside assistant replies count. Reported losses use KL(p || q) = CE - H(p) in
place of the cross-entropy (same gradient), so they fall to 0 at the optimum. bf16 autocast for compute
(``precision="auto"``: where the hardware computes bf16 natively; float32 elsewhere, e.g. on AVX2-only
CPUs, where PyTorch emulates bf16); fp32 master weights, optimizer state and losses. Under ``torchrun`` each process takes a disjoint share of the
sequences and DDP averages gradients (gloo on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sot.drafters.state import StatePredictor, grow_predictor, new_predictor, save_predictor
from sot.drafters.state.config import ARCHES, EAGLE3, NATIVE
from sot.errors import ConfigError
from sot.fingerprint import embedding_hash
from sot.models.support import text_config
from sot.train import changed_settings, check_run_folder
from sot.train.data import StateDataset
from sot.train.plots import write_plots


@dataclass
class TrainConfig:
    """Everything a run needs; saved as ``config.json`` in the run folder."""

    model: str = "default"
    data: str = ""
    out: str = ""
    steps: int = 2000
    tokens_per_step: int = 8192
    lr: float = 1e-3
    warmup: int = 30
    unroll: int = 5
    step_decay: float = 0.8
    state_weight: float = 0.2
    stability_weight: float = 0.02
    stability_every: int = 4
    state_noise: float = 0.05
    perturb: float = 0.01
    draft_vocab: int = 16384
    init: str = "target"
    init_from: str = ""
    #: predictor architecture: ``native`` or ``eagle3`` (EAGLE-3's draft layer, exportable to vLLM
    #: and SGLang); with ``init_from``, the file's
    arch: str = NATIVE
    #: decoder layers of the predictor; with ``init_from``, at least the file's (added layers start as the identity)
    decoder_layers: int = 1
    #: learning rate of layers added to an ``init_from`` file, as a multiple of ``lr`` (they start from zero output)
    added_lr_scale: float = 10.0
    #: with ``init_from``: count the draft vocabulary (``draft_vocab`` tokens) anew on ``data`` instead
    #: of keeping the file's (the weights carry over: the head rows are the target's)
    recount_vocab: bool = False
    eval_every: int = 200
    eval_sequences: int = 32
    eval_depth: int = 8
    save_every: int = 100
    seed: int = 0
    max_seconds: float = 0.0
    #: stop (with a checkpoint) after this step, the schedule still planned over ``steps`` (0: never)
    stop_after: int = 0
    grad_clip: float = 1.0
    precision: str = "auto"  # compute: "bf16" autocast, "fp32", or "auto" (bf16 where native)


PRECISIONS = ("auto", "bf16", "fp32")


def compute_autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast context of a training computation: bf16 for ``bf16``, off (float32) for
    ``fp32``, and for ``auto`` bf16 only where ``device`` computes it natively."""
    from sot.models.loading import native_bf16

    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    use_bf16 = precision == "bf16" or (precision == "auto" and native_bf16(device))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)


def warmup_cosine(step: int, lr: float, warmup: int, steps: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then a cosine decay
    to a tenth of ``lr`` at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ---------------------------------------------------------------------------- distributed
def _dist_setup() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        visible = torch.cuda.device_count()
        if local >= visible:
            raise ConfigError(
                f"training process {local} of this node has no GPU of its own ({visible} visible): run at most "
                f"{visible} per node (torchrun --nproc-per-node={visible}), or train on the CPU with the GPUs "
                "hidden (CUDA_VISIBLE_DEVICES=)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def _all_mean(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= world
    return x


# ---------------------------------------------------------------------------- losses
def sequence_loss(
    model: torch.nn.Module,
    pred: StatePredictor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    states: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    with_stability: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one sequence (``tokens [T]``, ``mask [T]``, ``states [T, S + 1, D]``) and its parts.

    ``model`` is what is called (the DDP wrapper or the predictor itself); ``pred`` is the
    bare predictor for the head and norms.
    """
    s = states.shape[1] - 1
    t = tokens.shape[0] - 1
    inp = states[:t, :s].unsqueeze(0).to(device).float()  # the cache is bf16; autocast casts back exactly
    target_h = states[1:, s].to(device).float()  # [t, D]
    nxt = tokens[1:].unsqueeze(0).to(device)
    weight = mask[1:].to(device)
    autocast = compute_autocast(device, cfg.precision)
    sel = torch.nonzero(weight > 0).flatten()  # assistant rows: only these enter the loss
    with torch.no_grad():
        target_logp = torch.log_softmax(target_h[sel] @ pred.head.float().T, dim=-1)
        target_p = target_logp.exp()
        target_ent = -(target_p * target_logp).sum(-1)  # H(p) per row, to report KL
        target_top = target_logp.argmax(-1)
        target_sel = target_h[sel]
    with autocast:
        perturb = cfg.perturb if (cfg.stability_weight > 0 and with_stability) else 0.0
        outs, moved = model(inp, nxt, cfg.unroll, cfg.state_noise, perturb)
    total = torch.zeros((), device=device)
    entropy_part = 0.0  # the constant H(p) inside the cross-entropy; reported losses omit it
    parts: dict[str, float] = {}
    norm_w = sum(cfg.step_decay**k for k in range(cfg.unroll))
    for k, g in enumerate(outs):
        keep = slice(int((sel < k).sum()), None)  # step k has no chain for rows t < k (sel is sorted)
        n = max(1, sel.numel() - keep.start)
        with autocast:
            gk = g[0, sel[keep]]
            logits = pred.logits(gk)
            normed = pred.out_norm(gk)
        # cross-entropy against the target's distribution; KL = CE - H(p) is reported
        ce = F.cross_entropy(logits.float(), target_p[keep], reduction="sum") / n
        reg = F.smooth_l1_loss(normed.float(), target_sel[keep], reduction="none").mean(-1).sum() / n
        total = total + (cfg.step_decay**k / norm_w) * (ce + cfg.state_weight * reg)
        with torch.no_grad():
            ent = float(target_ent[keep].sum() / n)
            entropy_part += (cfg.step_decay**k / norm_w) * ent
            parts[f"kl{k}"] = float(ce) - ent
            if k in (0, len(outs) - 1):  # top-1 agreement (argmax is slow on bf16; two steps suffice)
                parts[f"acc{k}"] = float((logits.float().argmax(-1) == target_top[keep]).float().sum() / n)
        if k == 0:
            parts["state0"] = float(reg.detach())
            base = normed
    if moved is not None:
        with autocast:
            moved_n = pred.out_norm(moved[0])
        change = (moved_n[sel].float() - base.float()).pow(2).mean(-1) / (cfg.perturb**2)
        stab = change.mean() if change.numel() else change.sum()
        total = total + cfg.stability_weight * stab
        parts["stability"] = float(stab.detach())
    parts["loss"] = float(total.detach()) - entropy_part  # KL-based: 0 at the optimum
    return total, parts


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(pred: StatePredictor, data: StateDataset, full_head: torch.Tensor, cfg: TrainConfig,
             device: torch.device, cache: dict) -> dict:
    """Greedy chain acceptance per depth on held-out sequences.

    A chain starts at every assistant row; depth ``d`` is accepted when the predictor's top
    token matches the target's (full-vocabulary) top token at depths ``1..d``. Returns
    ``accept_rate[d]`` (accepted at ``d`` given accepted at ``d - 1``), ``reach[d]`` and the
    expected tokens per step of a single greedy chain, ``1 + sum(reach)``.
    """
    pred.eval()
    depth = cfg.eval_depth
    reach = torch.zeros(depth, dtype=torch.float64)
    chains = 0.0
    vocab = pred.draft_vocab.to(device)
    for i in range(min(cfg.eval_sequences, len(data))):
        tokens, mask, states = data[i]
        s = states.shape[1] - 1
        t = tokens.shape[0] - 1
        if t <= depth:
            continue
        if i not in cache:
            cache[i] = (states[1:, s].to(device).float() @ full_head.T).argmax(-1)
        target_top = cache[i]  # [t] target's token at each row's next position
        with compute_autocast(device, cfg.precision):  # (the head too: its input is bf16 where autocast is on)
            outs = pred.forward_unrolled(states[:t, :s].unsqueeze(0).to(device).float(), tokens[1:].unsqueeze(0).to(device),
                                         depth)
            hits = torch.stack([vocab[pred.logits(g[0]).float().argmax(-1)] == target_top for g in outs])  # [K, t]
        starts = torch.nonzero(mask[1 : t - depth + 1].bool()).flatten()
        ok = torch.ones(starts.numel(), dtype=torch.bool, device=device)
        for k in range(depth):
            ok = ok & hits[k, starts.to(device) + k]
            reach[k] += ok.sum().item()
        chains += starts.numel()
    pred.train()
    reach = reach / max(chains, 1.0)
    rates = [float(reach[0])] + [float(reach[k] / reach[k - 1]) if reach[k - 1] > 0 else 0.0 for k in range(1, depth)]
    return {"reach": reach.tolist(), "accept_rate": rates, "chain_tau": 1.0 + float(reach.sum()), "chains": chains}


# ---------------------------------------------------------------------------- main loop
def draft_vocabulary(data: StateDataset, vocab_size: int, size: int) -> torch.Tensor | None:
    """The ``size`` most frequent assistant tokens of the training data, as sorted ids."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = data.token_counts(vocab_size)
    return counts.topk(size).indices.sort().values


def _check_config(cfg: TrainConfig) -> None:
    """Refuse settings that cannot work, before anything loads."""
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.arch not in ARCHES:
        raise ConfigError(f"arch must be one of {', '.join(ARCHES)}, got {cfg.arch!r}")
    if cfg.arch == EAGLE3 and cfg.decoder_layers != 1:
        raise ConfigError(f"an EAGLE-3 predictor has one decoder layer; drop --decoder-layers {cfg.decoder_layers}")
    if cfg.stop_after < 0:
        raise ConfigError(f"--stop-after must be a step number >= 0, got {cfg.stop_after}")
    if not (math.isfinite(cfg.max_seconds) and cfg.max_seconds >= 0):
        raise ConfigError(f"--max-seconds must be a finite number >= 0 (0: no limit), got {cfg.max_seconds}")
    if cfg.draft_vocab < 0:
        raise ConfigError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {cfg.draft_vocab}")
    if cfg.recount_vocab and not cfg.init_from:
        raise ConfigError("--recount-vocab applies to --init-from (a new predictor always counts its vocabulary)")


#: settings a resumed run must share with the run in its folder (they fix the predictor's shape,
#: its target or its data)
RESUME_KEYS = ("model", "data", "arch", "decoder_layers", "draft_vocab", "init_from", "init")


def _check_resume(out: Path, saved: dict, asked: dict) -> None:
    """A :class:`ConfigError` naming the settings that differ from the run kept in ``out``."""
    def paths(settings: dict) -> dict:  # ("cache/" and "cache" are one folder)
        return {k: ",".join(os.path.normpath(p) for p in v.split(",")) if k in ("data", "init_from", "model") and
                isinstance(v, str) and v else v for k, v in settings.items()}

    differ = changed_settings(paths(saved), paths(asked), RESUME_KEYS)
    if differ:
        raise ConfigError(f"{out} holds a run started with {', '.join(differ)}; resume it with those settings, "
                          "or give another --out")


def _stop_reason(cfg: TrainConfig, step: int, seconds: float) -> str | None:
    """Why a run stops at ``step`` after ``seconds`` of training in all (``None``: it goes on)."""
    if cfg.stop_after and step >= cfg.stop_after:
        return "--stop-after"
    if cfg.max_seconds and seconds >= cfg.max_seconds:
        return "--max-seconds"
    return None


class Diverged(ConfigError):
    """The loss stopped being a finite number: the run's settings (the learning rate) do not fit."""


def terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # (SIGTERM from a scheduler, timeout or docker stop: save, as Ctrl-C does)


def fit(cfg: TrainConfig) -> Path:
    """Train (or resume) a state predictor; returns the path of the final predictor file.
    SIGTERM and Ctrl-C save the steps done, and the same command resumes; a loss that stops
    being finite stops the run with :class:`Diverged`, keeping the last checkpoint saved."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate_as_interrupt) if main else None
    try:
        return _fit(cfg)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _fit(cfg: TrainConfig) -> Path:
    from tqdm import tqdm

    from sot.models.loading import load_model

    _check_config(cfg)
    out = Path(cfg.out)
    check_run_folder(out, {"model", "data", "out"}, "fit")
    rank, world, device = _dist_setup()
    data_dirs = [Path(d) for d in cfg.data.split(",") if d]
    if not data_dirs:
        raise ConfigError("--data names no state cache folder")
    data_dir = data_dirs[0]  # held-out evaluation comes from the first folder
    train = StateDataset([d / "train" for d in data_dirs])
    evals_data = StateDataset(data_dir / "eval") if (data_dir / "eval" / "meta.json").is_file() else None
    if evals_data is None and rank == 0:
        print(f"no held-out evaluation: {data_dir / 'eval'} holds no finished state cache ('sot train prepare' "
              "writes one beside the training cache)", file=sys.stderr)
    loaded = load_model(cfg.model, dtype=torch.float32)
    target = loaded.model
    hidden = text_config(target.config).hidden_size
    if train.meta["hidden_size"] != hidden:
        raise ConfigError(f"state cache {data_dir} was made for hidden size {train.meta['hidden_size']}, "
                          f"the model has {hidden}")
    made_with = train.meta.get("embed_hash")  # (caches written before it was recorded have none)
    if made_with is not None and made_with != embedding_hash(target.get_input_embeddings().weight):
        raise ConfigError(f"state cache {data_dir} was made with another model than {cfg.model}; "
                          "prepare one with this --model")
    shortest = cfg.unroll + 2  # an unrolled chain of --unroll steps needs that many tokens
    if not any(train.length(i) >= shortest for i in range(len(train))):
        raise ConfigError(f"state cache {data_dir} holds no sequence of {shortest} tokens or more, which "
                          f"--unroll {cfg.unroll} needs; lower --unroll or cache longer conversations")
    if cfg.arch == EAGLE3 and len(train.layers) != 3:
        raise ConfigError(f"--arch eagle3 reads three target layers; state cache {data_dir} holds "
                          f"{len(train.layers)} ({train.layers}): prepare it with three --layers")
    vocab_size = target.get_input_embeddings().weight.shape[0]
    if cfg.init_from:  # continue from a predictor file (e.g. the shipped one) with fresh optimizer state
        recounted = (draft_vocabulary(train, vocab_size, cfg.draft_vocab),) if cfg.recount_vocab else None
        pred, added = grow_predictor(cfg.init_from, target, train.layers, cfg.decoder_layers, recounted, cfg.seed,
                                     cfg.init)
        kept = int(pred.draft_vocab.numel())
        if recounted is None and cfg.draft_vocab != TrainConfig.draft_vocab and kept != min(cfg.draft_vocab or
                                                                                           vocab_size, vocab_size):
            raise ConfigError(f"--init-from keeps its file's draft vocabulary ({kept} tokens): drop --draft-vocab "
                              f"{cfg.draft_vocab}, or add --recount-vocab to count a new one of that size")
        if pred.config.arch != cfg.arch:
            raise ConfigError(f"{cfg.init_from} is a predictor of architecture {pred.config.arch}; continue it with "
                              f"--arch {pred.config.arch}, or drop --init-from to start a new {cfg.arch} one")
        pred = pred.float().to(device)
    else:
        pred = new_predictor(target, train.layers, draft_vocabulary(train, vocab_size, cfg.draft_vocab), cfg.seed,
                             cfg.init, cfg.decoder_layers, cfg.arch).to(device)
        added = set()
    full_head = target.get_output_embeddings().weight.detach().float().to(device)
    model: torch.nn.Module = pred
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(pred)
    named = [(n, p) for n, p in pred.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # layers added to an --init-from file learn faster: their outputs start at zero
    groups = [{"params": [p for n, p in named if n not in added], "scale": 1.0},
              {"params": [p for n, p in named if n in added], "scale": cfg.added_lr_scale}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        return warmup_cosine(step, cfg.lr, cfg.warmup, cfg.steps)

    start, history, evals, seen_tokens, elapsed_before = 0, [], [], 0, 0.0
    drawn, seen_sequences, rng = 0, 0, None
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file():
        try:
            state = torch.load(ckpt, map_location=device, weights_only=False)
        except Exception as exc:  # noqa: BLE001 (a cut or damaged file fails in zipfile or pickle, each its own way)
            raise ConfigError(f"{ckpt} cannot be read ({type(exc).__name__}): delete it to start this run "
                              "again, or give another --out") from None
        _check_resume(out, state.get("config", {}), asdict(cfg))
        try:
            pred.load_state_dict(state["model"])
        except RuntimeError:
            raise ConfigError(f"{out}/checkpoint.pt holds a predictor of another shape; resume it with the "
                              "settings it was started with, or give another --out") from None
        opt.load_state_dict(state["optimizer"])
        start, history, evals = state["step"], state["history"], state["evals"]
        seen_tokens, elapsed_before = state.get("tokens", 0), state.get("seconds", 0.0)
        if world == 1 and "drawn" in state:  # the data stream and the noise go on where they were
            drawn, seen_sequences, rng = state["drawn"], state["sequences"], state["rng"]
        if rank == 0:
            print(f"resuming {out} at step {start}", file=sys.stderr)
            earlier = state.get("config", {})
            differ = changed_settings(earlier, asdict(cfg), [k for k in asdict(cfg) if k not in ("steps", "out")])
            if differ and start < cfg.steps:
                print(f"the steps after {start} train with settings changed since: {', '.join(differ)}",
                      file=sys.stderr)
    # config.json says how the run trains: written when it starts, and when a resumed run has
    # steps left to train under the settings given now
    if rank == 0 and start < cfg.steps:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    # one shuffled stream from --seed, taken up where a resumed run left it (with several ranks,
    # each rank's stream starts anew, reshuffled by the step); the noise is seeded the same way
    if world == 1:
        stream = train.iter_indices(cfg.seed)
        for _ in range(drawn):
            next(stream)
    else:
        stream = train.iter_indices(cfg.seed + start, rank, world)
    if isinstance(rng, torch.Tensor):
        rng = (rng, None)
    if rng is not None:
        torch.set_rng_state(rng[0].cpu())  # (torch.load moved it to the run's device)
        if rng[1] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(rng[1].cpu(), device)
    else:
        torch.manual_seed(cfg.seed + 7919 * (start + 1) + rank)

    def rng_state() -> tuple:  # the noise's generators: the CPU's and, training on a GPU, its own
        return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    at_step = (drawn, seen_sequences, rng_state())  # where the last completed step left them
    eval_cache: dict = {}

    def save(step: int, seconds: float) -> None:
        if rank != 0:
            return
        if not all(torch.isfinite(p).all() for p in pred.parameters()):
            raise Diverged(f"the predictor's weights are not finite numbers at step {step}: the run diverged; "
                           f"{out} keeps its last checkpoint. Lower --lr (now {cfg.lr:g}) and train again, "
                           "in a new --out")
        tmp = out / "checkpoint.pt.tmp"
        torch.save({"model": pred.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                    "evals": evals, "tokens": seen_tokens, "seconds": seconds, "config": asdict(cfg),
                    "drawn": at_step[0], "sequences": at_step[1], "rng": at_step[2]}, tmp)
        tmp.replace(ckpt)
        save_predictor(pred, out / "predictor.safetensors")
        write_plots(out, history, evals)

    def run_eval(step: int) -> None:
        if rank == 0 and evals_data is not None:
            r = evaluate(pred, evals_data, full_head, cfg, device, eval_cache)
            r["step"] = step
            if not r.get("chains"):  # (not kept: zero acceptance would be a figure nothing measured)
                tqdm.write(f"step {step}: no held-out chain to evaluate (every held-out answer is shorter than "
                           f"the evaluated depth {cfg.eval_depth} + 1 tokens)")
                return
            evals.append(r)
            tqdm.write(f"step {step}: held-out greedy acceptance per depth "
                       + " ".join(f"{x:.2f}" for x in r["accept_rate"]) + f"; chain tau {r['chain_tau']:.2f}")

    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    pred.train()
    step = start
    if start == 0:
        run_eval(0)
    why = _stop_reason(cfg, start, elapsed_before) if start else None
    if why is not None and rank == 0:  # (a run that stopped there: running it again trains nothing)
        tqdm.write(f"{out} stopped at step {start} ({why}); nothing to do")
    done_seconds = elapsed_before  # training time at the last completed step
    try:
        while step < cfg.steps and why is None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step) * group.get("scale", 1.0)
            opt.zero_grad(set_to_none=True)
            batch, ntok = [], 0
            while ntok < cfg.tokens_per_step // world:
                index = next(stream)
                drawn += 1
                if train.length(index) < shortest:  # (too short to unroll: it would give no chain)
                    continue
                item = train[index]
                batch.append(item)
                ntok += item[0].shape[0]
            agg: dict[str, float] = {}
            stab_sum, stab_n = 0.0, 0
            for j, (tokens, mask, states) in enumerate(batch):
                sync = j == len(batch) - 1
                ctx = model.no_sync() if (world > 1 and not sync) else nullcontext()
                with ctx:
                    seen_sequences += 1
                    stab = seen_sequences % cfg.stability_every == 0  # the extra pass on every n-th sequence
                    loss, parts = sequence_loss(model, pred, tokens, mask, states, cfg, device, stab)
                    (loss * tokens.shape[0] / ntok).backward()
                stab_val = parts.pop("stability", None)
                if stab_val is not None:
                    stab_sum, stab_n = stab_sum + stab_val, stab_n + 1
                for key, val in parts.items():
                    agg[key] = agg.get(key, 0.0) + val * tokens.shape[0] / ntok
            agg["stability"] = stab_sum / stab_n if stab_n else 0.0
            finite = torch.tensor([1.0 if all(math.isfinite(v) for v in agg.values()) else 0.0])
            if world > 1:  # (every rank stops together, none waits in a collective for one gone)
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not finite.item():
                raise Diverged(f"the loss is not a finite number at step {step + 1} ({agg.get('loss')}): the run "
                               f"diverged; {out} keeps its last checkpoint. Lower --lr (now {cfg.lr:g}) and "
                               "train again, in a new --out")
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            at_step = (drawn, seen_sequences, rng_state())
            seen_tokens += ntok * world
            vals = _all_mean(torch.tensor([agg[k] for k in sorted(agg)]), world)
            record = {k: float(v) for k, v in zip(sorted(agg), vals)}
            record.update(step=step, lr=lr_at(step - 1), tokens=seen_tokens)
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc0']:.2f}", kl0=f"{record['kl0']:.2f}")
            seconds = done_seconds = elapsed_before + time.perf_counter() - t0
            stop = torch.tensor([1.0 if _stop_reason(cfg, step, seconds) else 0.0])
            if world > 1:
                dist.broadcast(stop, 0)
            if step % cfg.eval_every == 0 or step == cfg.steps or stop.item():
                run_eval(step)
            if step % cfg.save_every == 0 or step == cfg.steps or stop.item():
                save(step, seconds)
            if stop.item():
                if rank == 0:
                    tqdm.write(f"stopping after {seconds:.0f}s at step {step} ({_stop_reason(cfg, step, seconds)})")
                break
    except KeyboardInterrupt:  # keep the steps done since the last save
        if step > start and rank == 0:
            save(step, done_seconds)
            tqdm.write(f"interrupted: {out} saved at step {step}; the same command resumes it", file=sys.stderr)
        raise
    finally:  # (a stopped run's bar ends its line too, rather than being redrawn at exit)
        bar.close()
    if rank == 0:
        summary = {"steps": step, "tokens": seen_tokens, "seconds": elapsed_before + time.perf_counter() - t0,
                   "world_size": world, "final": history[-1] if history else {}, "eval": evals[-1] if evals else {}}
        (out / "train.json").write_text(json.dumps(summary, indent=2))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return out / "predictor.safetensors"
