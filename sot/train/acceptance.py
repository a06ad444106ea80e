"""``sot train policy``: train the ``learned`` commit policy's acceptance model.

1. **Traces.** The target decodes ShareGPT training prompts (taken from the end of the shuffled
   training list, so mostly conversations the state predictor never saw; the held-out split
   is skipped) with the state drafter, verifying every proposed tree whole. Each verified node
   is logged with its features (:func:`sot.policy.node_features`) and whether the target
   accepted it. Several temperatures are mixed in so that the model also sees content where
   drafts rarely survive.
2. **Fit.** A small MLP (:class:`sot.policy.AcceptanceModel`) is fitted to those labels by
   binary cross-entropy, on 90% of the sequences; the rest measures it against the heuristic
   policy's estimate (calibrated draft confidence) on the same nodes.

The output folder holds ``traces.pt``, ``policy.safetensors``, ``report.json`` and
``calibration.png`` (predicted vs observed acceptance).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from sot.drafters.base import TreeBudget
from sot.errors import ConfigError


@dataclass(frozen=True)
class PolicyTrainConfig:
    """Settings of ``sot train policy``."""

    model: str = "default"
    predictor: str | None = None
    out: str = "runs/policy"
    prompts: int = 48
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    batch_size: int = 4
    max_nodes: int = TreeBudget.max_nodes
    max_depth: int = TreeBudget.max_depth
    epochs: int = 60
    lr: float = 3e-3
    seed: int = 0


def training_prompts(limit: int) -> list[str]:
    """First user turns of ``limit`` training conversations, from the end of the shuffled list."""
    from sot.train.data import to_messages, training_conversations

    out: list[str] = []
    for conv in reversed(training_conversations()):
        messages = to_messages(conv)
        if messages and messages[0]["role"] == "user" and len(messages[0]["content"]) < 2000:
            out.append(messages[0]["content"])
        if len(out) >= limit:
            break
    return out


def collect_traces(cfg: PolicyTrainConfig) -> dict:
    """Decode the training prompts at each temperature and return the logged traces:
    ``features [M, F]``, ``accepted [M]``, ``group [M]`` (which batch each node came from)."""
    from tqdm import tqdm

    from sot.drafters import DrafterKind, TreeBudget, make_drafter
    from sot.engine import Engine, GenerationParams
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.prompts import encode
    from sot.sampling import SamplingParams

    loaded = load_model(cfg.model, dtype=torch.bfloat16)
    drafter = make_drafter(DrafterKind.STATE, loaded.model, cfg.predictor)
    target = TargetModel(loaded.model, state_layers=drafter.state_layers)
    engine = Engine(target, drafter, TreeBudget(cfg.max_nodes, cfg.max_depth), record_policy=True)
    texts = training_prompts(cfg.prompts)
    if not texts:
        raise ConfigError("no training prompts found")
    ids = [encode(loaded.tokenizer, {"turns": [t]}, True) for t in texts]
    eos = (int(loaded.tokenizer.eos_token_id),) if loaded.tokenizer.eos_token_id is not None else ()
    feats, labels, groups = [], [], []
    runs = [(t, i) for t in cfg.temperatures for i in range(0, len(ids), cfg.batch_size)]
    with tqdm(total=len(cfg.temperatures) * len(ids), desc="policy traces", unit="seq") as bar:
        for run, (temp, start) in enumerate(runs):
            chunk = ids[start : start + cfg.batch_size]
            params = GenerationParams(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos,
                                      sampling=SamplingParams(temperature=temp, seed=cfg.seed + start))
            engine.generate(chunk, params)
            trace = engine.policy_trace
            for f, a in zip(trace.features, trace.accepted):
                feats.append(f)
                labels.append(a)
                groups.append(torch.full((a.numel(),), run))
            bar.update(len(chunk))
    from sot.fingerprint import embedding_hash

    return {"features": torch.cat(feats), "accepted": torch.cat(labels), "group": torch.cat(groups),
            "embed_hash": embedding_hash(loaded.model.get_input_embeddings().weight),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}}


def _log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-4, 1 - 1e-4)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def heuristic_estimate(features: torch.Tensor) -> torch.Tensor:
    """The heuristic policy's acceptance estimate of the same nodes: calibration x confidence."""
    from sot.policy import FEATURES

    conf = features[:, FEATURES.index("log_conf")].exp()
    return (features[:, FEATURES.index("calibration")] * conf).clamp(max=1.0)


def fit_acceptance(traces: dict, epochs: int = 60, lr: float = 3e-3, seed: int = 0):
    """Fit an :class:`AcceptanceModel` on 90% of the sequences; returns it and a report that
    compares its log-loss and calibration with the heuristic's on the other 10%."""
    from tqdm import tqdm

    from sot.policy import AcceptanceModel

    x, y, g = traces["features"], traces["accepted"], traces["group"]
    if x.shape[0] < 50:
        raise ConfigError(f"only {x.shape[0]} logged nodes; decode more prompts")
    groups = sorted(set(g.tolist()))
    random.Random(seed).shuffle(groups)
    held = set(groups[: max(1, len(groups) // 10)])
    val = torch.tensor([int(v) in held for v in g.tolist()])
    torch.manual_seed(seed)
    model = AcceptanceModel()
    model.mean.copy_(x[~val].mean(0))
    model.std.copy_(x[~val].std(0).clamp(min=1e-3))
    model.low.copy_(x[~val].min(0).values)
    model.high.copy_(x[~val].max(0).values)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    xt, yt = x[~val], y[~val]
    batch = 4096
    history = []
    for _ in tqdm(range(epochs), desc="fit policy", unit="epoch"):
        perm = torch.randperm(xt.shape[0])
        total = 0.0
        for i in range(0, xt.shape[0], batch):
            idx = perm[i : i + batch]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model.logits(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        history.append(total / xt.shape[0])
    model.eval()
    with torch.no_grad():
        pv = model(x[val])
    hv = heuristic_estimate(x[val])
    yv = y[val]
    report = {
        "nodes": int(x.shape[0]), "train_nodes": int((~val).sum()), "val_nodes": int(val.sum()),
        "accept_rate": float(y.mean()),
        "val_log_loss": {"learned": _log_loss(pv, yv), "heuristic": _log_loss(hv, yv)},
        "val_mean_predicted": {"learned": float(pv.mean()), "heuristic": float(hv.mean()), "observed": float(yv.mean())},
        "train_loss": history,
        "calibration": _reliability(pv, hv, yv),
    }
    return model, report


def _reliability(learned: torch.Tensor, heuristic: torch.Tensor, y: torch.Tensor, bins: int = 10) -> dict:
    out = {}
    for name, p in (("learned", learned), ("heuristic", heuristic)):
        rows = []
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            sel = (p >= lo) & ((p < hi) if b < bins - 1 else (p <= hi))
            if sel.any():
                rows.append([float(p[sel].mean()), float(y[sel].mean()), int(sel.sum())])
        out[name] = rows
    return out


def write_calibration_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for name, rows in report["calibration"].items():
        if rows:
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=name)
    ax.set_xlabel("predicted acceptance")
    ax.set_ylabel("observed acceptance")
    ax.set_title("held-out nodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_policy(cfg: PolicyTrainConfig) -> Path:
    """Collect traces (reused from ``out/traces.pt`` when present), fit, and write the model."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_file = out / "traces.pt"
    if trace_file.is_file():
        traces = torch.load(trace_file, weights_only=False)
    else:
        traces = collect_traces(cfg)
        torch.save(traces, trace_file)
    model, report = fit_acceptance(traces, cfg.epochs, cfg.lr, cfg.seed)
    report["config"] = traces.get("config", {})
    path = out / "policy.safetensors"
    model.save(path, {"embed_hash": traces.get("embed_hash", ""), "drafter": "state"})
    (out / "report.json").write_text(json.dumps(report, indent=1))
    write_calibration_plot(report, out / "calibration.png")
    ll = report["val_log_loss"]
    if not all(math.isfinite(v) for v in ll.values()):
        raise ConfigError("the fit diverged (non-finite loss)")
    return path
