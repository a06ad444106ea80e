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

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sot.drafters.base import TreeBudget
from sot.errors import ConfigError
from sot.files import replace_file
from sot.train import changed_settings

if TYPE_CHECKING:
    from sot.policy import AcceptanceModel


@dataclass(frozen=True)
class PolicyTrainConfig:
    """Settings of ``sot train policy``."""

    model: str = "default"
    predictor: str | None = None
    out: str = "runs/policy"
    kind: str = "learned"  # or "rl" (sot.train.rl)
    prompts: int = 48
    code_prompts: int = 16  # coding requests made from the standard library (sot.train.code_prompts)
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0, 1.5)
    batch_sizes: tuple[int, ...] = (1, 4)
    dtype: str = "auto"
    # (recorded trees keep the predictor's own size, as the shipped model was trained on; at run
    # time it reads merged trees up to the whole budget, its inputs clipped to this range)
    max_nodes: int = TreeBudget.predictor_nodes
    max_depth: int = TreeBudget.predictor_depth
    epochs: int = 60
    rl_epochs: int = 60  # replays of the training runs (kind rl)
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


def code_training_prompts(limit: int, seed: int = 0) -> list[str]:
    """``limit`` coding requests from the standard library's documented functions."""
    from sot.data.humaneval import CHAT_INSTRUCTION
    from sot.train.code_prompts import stdlib_function_stubs

    if limit <= 0:
        return []
    stubs = list(stdlib_function_stubs())
    random.Random(seed).shuffle(stubs)
    return [CHAT_INSTRUCTION.format(code=stub) for _, stub in stubs[:limit]]


def collect_traces(cfg: PolicyTrainConfig) -> dict:
    """Decode the training prompts at each temperature and batch size and return the logged
    traces: ``features [M, F]``, ``accepted [M]``, ``group [M]`` (which batch each node came
    from) for the acceptance model, and for the rl policy's simulator ``runs`` (per batch,
    its :func:`~sot.policy.simulate.step_record` steps), the cost model (``cost_rows``,
    ``cost_seconds``) and whether passes pack flat. Sampling is coupled, so every run is
    reproducible and the simulator's counterfactuals are exact."""
    from tqdm import tqdm

    from sot.drafters import DrafterKind, TreeBudget, make_drafter
    from sot.engine import Engine, GenerationParams
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.prompts import encode
    from sot.sampling import SamplingParams

    from sot.models.loading import resolve_dtype
    from sot.sampling import SamplingMode

    loaded = load_model(cfg.model, dtype=resolve_dtype(cfg.dtype))
    drafter = make_drafter(DrafterKind.STATE, loaded.model, cfg.predictor)
    target = TargetModel(loaded.model, state_layers=drafter.state_layers)
    engine = Engine(target, drafter, TreeBudget(cfg.max_nodes, cfg.max_depth), record_policy=True)
    texts = training_prompts(cfg.prompts) + code_training_prompts(cfg.code_prompts, cfg.seed)
    if not texts:
        raise ConfigError("no training prompts found")
    ids = [encode(loaded.tokenizer, {"turns": [t]}, True) for t in texts]
    eos = (int(loaded.tokenizer.eos_token_id),) if loaded.tokenizer.eos_token_id is not None else ()
    feats, labels, groups, steps = [], [], [], []
    # every prompt at every temperature; the batch sizes take turns over the prompts
    runs = []
    for t in cfg.temperatures:
        for j, bs in enumerate(cfg.batch_sizes):
            mine = [i for i in range(len(ids)) if i % len(cfg.batch_sizes) == j]
            runs += [(t, mine[i : i + bs]) for i in range(0, len(mine), bs)]
    with tqdm(total=sum(len(r[1]) for r in runs), desc="policy traces", unit="seq") as bar:
        for run, (temp, members) in enumerate(runs):
            chunk = [ids[i] for i in members]
            params = GenerationParams(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos,
                                      sampling=SamplingParams(temperature=temp, seed=cfg.seed + members[0],
                                                              mode=SamplingMode.COUPLED))
            engine.generate(chunk, params)
            trace = engine.policy_trace
            for f, a in zip(trace.features, trace.accepted):
                feats.append(f)
                labels.append(a)
                groups.append(torch.full((a.numel(),), run))
            steps.append(trace.steps)
            bar.update(len(chunk))
    from sot.fingerprint import embedding_hash, predictor_fingerprint

    cost = engine.cost_model()
    return {"features": torch.cat(feats), "accepted": torch.cat(labels), "group": torch.cat(groups),
            "runs": steps, "cost_rows": list(cost.rows), "cost_seconds": list(cost.seconds),
            "flat": bool(engine.policy.flat), "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "embed_hash": embedding_hash(loaded.model.get_input_embeddings().weight),
            "predictor_hash": predictor_fingerprint(drafter.predictor),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}}


def _log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-4, 1 - 1e-4)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def heuristic_estimate(features: torch.Tensor) -> torch.Tensor:
    """The heuristic policy's acceptance estimate of the same nodes: calibration x confidence."""
    from sot.policy import FEATURES

    conf = features[:, FEATURES.index("log_conf")].exp()
    return (features[:, FEATURES.index("calibration")] * conf).clamp(max=1.0)


def fit_acceptance(traces: dict, epochs: int = 60, lr: float = 3e-3,
                   seed: int = 0) -> tuple[AcceptanceModel, dict]:
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
    """Predicted against observed acceptance on the held-out nodes, for the learned model and
    the heuristic, as a PNG at ``path``."""

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


#: settings the kept traces of a run folder were collected with (reused only with the same)
TRACE_KEYS = ("model", "predictor", "prompts", "code_prompts", "max_new_tokens", "temperatures", "batch_sizes",
              "dtype", "max_nodes", "max_depth", "seed")


def load_or_collect(cfg: PolicyTrainConfig) -> dict:
    """The traces of ``cfg.out/traces.pt`` when present, else new ones (saved there)."""
    out = Path(cfg.out)
    trace_file = out / "traces.pt"
    if cfg.predictor and not Path(cfg.predictor).exists():
        raise ConfigError(f"--predictor {cfg.predictor}: no such file or folder")
    out.mkdir(parents=True, exist_ok=True)
    digest = _file_digest(cfg.predictor)
    if trace_file.is_file():
        try:  # (plain types and tensors: nothing else is unpickled)
            traces = torch.load(trace_file, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
            raise ConfigError(f"{trace_file} cannot be read ({type(exc).__name__}); it is damaged or not a "
                              "run's traces: delete it to collect them anew") from None
        if not isinstance(traces, dict):
            raise ConfigError(f"{trace_file} is not a run's traces: delete it to collect them anew")
        saved = traces.get("config", {})
        asked = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
        differ = changed_settings(saved, asked, TRACE_KEYS)
        same_file = saved.get("predictor", cfg.predictor) == cfg.predictor  # (another name is said above)
        if same_file and traces.get("predictor_digest", digest) != digest:
            differ.append(f"another predictor in {cfg.predictor} (the file has changed since)")
        if differ:
            raise ConfigError(f"{trace_file} was collected with {', '.join(differ)}; delete it to collect traces "
                              "anew, or give another --out")
        return traces
    traces = collect_traces(cfg)
    traces["predictor_digest"] = digest
    replace_file(trace_file, lambda part: torch.save(traces, part))  # (a run stopped meanwhile leaves no half file)
    return traces


def _file_digest(path: str | None) -> str | None:
    """The SHA-256 of a predictor file (``None`` for the default predictor)."""
    if not path or not Path(path).is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def train_policy(cfg: PolicyTrainConfig) -> Path:
    """Collect traces (reused from ``out/traces.pt`` when present), fit, and write the
    acceptance model of ``learned`` (``kind="rl"``: :func:`sot.train.rl.train_rl_policy`)."""
    out = Path(cfg.out)
    traces = load_or_collect(cfg)
    model, report = fit_acceptance(traces, cfg.epochs, cfg.lr, cfg.seed)
    report["config"] = traces.get("config", {})
    ll = report["val_log_loss"]
    weights_ok = all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())
    if not weights_ok or not all(math.isfinite(v) for v in ll.values()):  # (before anything is written over)
        raise ConfigError(f"the fit diverged (non-finite loss); {out} keeps what it held (a lower --lr may fit)")
    path = out / "policy.safetensors"
    model.save(path, {"embed_hash": traces.get("embed_hash", ""), "drafter": "state",
                      **({"predictor_hash": traces["predictor_hash"]} if traces.get("predictor_hash") else {})})
    (out / "report.json").write_text(json.dumps(report, indent=1))
    write_calibration_plot(report, out / "calibration.png")
    return path
