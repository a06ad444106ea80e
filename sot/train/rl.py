"""``sot train policy --kind rl``: train the ``rl`` commit policy on simulated speed.

1. **Traces** as for ``learned`` (:func:`sot.train.acceptance.collect_traces`): ShareGPT
   training prompts and coding requests, at each temperature (coupled sampling) and batch
   size, every drafted tree verified whole with its free drafts merged in.
2. **Simulator** (:mod:`sot.policy.simulate`): the logged steps are replayed through the
   policy; every candidate of every step gets its exact reward, ``(tokens - mu * time) /
   batch``, time counted in plain-decoding steps at the step's batch size. ``mu`` is the
   heuristic's simulated speed-up on the same steps, so maximising the reward maximises
   tokens per second (the Dinkelbach form of a ratio objective).
3. **Training**: each epoch replays the training runs with the current network (on the
   recorded machine, or one whose rows or predictor passes cost 0.5x or 2x as much, in turn,
   so the network does not overfit one cost curve), then takes gradient steps on the
   expected reward of its softmax over the candidates (all rewards are known, so the
   expectation is exact: the zero-variance form of REINFORCE with a baseline) and of its
   draft-or-free choice. Every sampling temperature weighs the same (sampled text takes
   many more steps than greedy text). After each epoch the network is replayed on
   validation batches (15% of the training ones); the epoch kept is the one whose worst
   temperature beats the heuristic by the most, and if none beats it, the untrained network,
   which decides as the heuristic does.
4. **Report**: the held-out runs (15% of the batches, never trained or selected on) replayed
   with ``heuristic``, ``learned`` (where an acceptance model fits) and ``rl`` on every
   simulated machine, and by temperature.

The folder gets ``rl-policy.safetensors``, ``rl-report.json`` and ``rl-reward.png``.
"""
from __future__ import annotations

import copy
import json
import math
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sot.errors import ConfigError
from sot.policy.rl import DRAFT_FEATURES, RLPolicyModel
from sot.policy.simulate import (
    ReplayResult, SimCost, machine_from_traces, policy_for_replay, replay,
)

if TYPE_CHECKING:
    from sot.policy.acceptance_model import AcceptanceModel
    from sot.train.acceptance import PolicyTrainConfig

#: the simulated machines besides the recorded one: (row-cost slope, predictor-pass cost)
MACHINES = ((1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.5), (1.0, 2.0))
#: gradient steps on each replay's samples
INNER_STEPS = 20


def split_runs(runs: list, held_out: float, seed: int) -> tuple[list, list]:
    """Training and held-out runs (whole batches, a seeded ``held_out`` share of them)."""
    order = list(range(len(runs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(held_out * len(runs))) if len(runs) > 1 else 0
    val = set(order[:n_val])
    return [r for i, r in enumerate(runs) if i not in val], [r for i, r in enumerate(runs) if i in val]


def _select_loss(model: RLPolicyModel, samples: list) -> torch.Tensor:
    """Minus the mean expected reward of the network's softmax over each step's candidates."""
    width = max(s.features.shape[0] for s in samples)
    n_feat = samples[0].features.shape[1]
    x = torch.zeros(len(samples), width, n_feat)
    r = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, s in enumerate(samples):
        k = s.features.shape[0]
        x[i, :k], r[i, :k], mask[i, :k] = s.features, s.reward - s.reward.mean(), True
    r = r / r[mask].std().clamp(min=1e-6)  # rewards in units of their spread: one step size fits any machine
    step = torch.stack([s.step for s in samples]).unsqueeze(1)
    logits = model.select_logits(x, step).masked_fill(~mask, -1e9)
    w = _balance([float(s.step[0]) for s in samples])
    return -((torch.softmax(logits, -1) * r).sum(-1) * w).sum()


def _draft_loss(model: RLPolicyModel, samples: list) -> torch.Tensor:
    x = torch.stack([s.features for s in samples])
    free = torch.tensor([s.free for s in samples])
    draft = torch.tensor([s.draft for s in samples])
    gain = free - draft
    gain = gain / gain.std().clamp(min=1e-6) if gain.numel() > 1 else gain
    p = torch.sigmoid(model.free_logit(x))
    return -(p * gain * _balance([float(t) for t in x[:, DRAFT_FEATURES.index("temperature")]])).sum()


def _balance(temperatures: list[float]) -> torch.Tensor:
    """Sample weights that give every sampling temperature the same total weight (summing to
    1): sampled text takes many more steps than greedy text, and would otherwise dominate."""
    counts: dict[float, int] = {}
    for t in temperatures:
        counts[round(t, 3)] = counts.get(round(t, 3), 0) + 1
    w = torch.tensor([1.0 / counts[round(t, 3)] for t in temperatures])
    return w / w.sum()


def _summary(res: ReplayResult) -> dict:
    return {"speedup": res.speedup, "tokens": res.tokens, "steps": res.steps, "rows": res.rows,
            "plain_steps": res.plain_steps, "reward": statistics.fmean(res.rewards) if res.rewards else 0.0}


def train_rl(traces: dict, epochs: int = 30, lr: float = 3e-3, seed: int = 0, held_out: float = 0.15,
             acceptance: AcceptanceModel | None = None, progress: bool = True) -> tuple[RLPolicyModel, dict]:
    """Train an :class:`RLPolicyModel` on the simulator over ``traces`` (see the module
    docstring). Returns the network and a report: the reward curve and the held-out speed-ups
    of every policy on every simulated machine."""
    from tqdm import tqdm

    runs = traces.get("runs")
    if not runs:
        raise ConfigError("these traces hold no step records; delete traces.pt and collect new ones")
    train, val = split_runs(runs, held_out, seed)
    # a validation share of the training batches picks the epoch kept (the held-out ones only report)
    train, check = split_runs(train, held_out, seed + 1)
    if not train:
        raise ConfigError("too few recorded batches to train on; decode more prompts")
    base = machine_from_traces(traces)
    flat = bool(traces.get("flat", True))
    machines: list[SimCost] = [base.scaled(slope, passes) for slope, passes in MACHINES]
    # mu per machine: the heuristic's simulated speed-up on the training steps
    mus = [replay(policy_for_replay("heuristic"), train, m, flat).speedup for m in machines]
    torch.manual_seed(seed)
    model = RLPolicyModel()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    check_by_temp = _by_temperature(check or train)
    heuristic_check = {t: replay(policy_for_replay("heuristic"), r, base, flat).speedup for t, r in check_by_temp.items()}

    def worst_ratio() -> float:
        """The network's simulated speed over the heuristic's on the validation batches, at
        the temperature where it does worst."""
        with torch.no_grad():
            return min(replay(policy_for_replay("rl", rl=model), r, base, flat).speedup / heuristic_check[t]
                       for t, r in check_by_temp.items())

    # the untrained network decides as the heuristic does (ratio 1): training must beat that
    best_score, best_epoch, best_state = 1.0, -1, copy.deepcopy(model.state_dict())
    bar = tqdm(range(epochs), desc="rl policy", unit="epoch", disable=not progress)
    for epoch in bar:
        i = epoch % len(machines)
        model.eval()
        with torch.no_grad():
            res = replay(policy_for_replay("rl", rl=model), train, machines[i], flat, mu=mus[i], collect=True)
        history.append({"epoch": epoch, "machine": list(MACHINES[i]), "reward": statistics.fmean(res.rewards),
                        "speedup": res.speedup, "heuristic_speedup": mus[i]})
        bar.set_postfix(vs_heuristic=f"{res.speedup / mus[i]:.3f}")
        model.train()
        for _ in range(INNER_STEPS):
            loss = torch.zeros(())
            if res.select:
                loss = loss + _select_loss(model, res.select)
            if res.draft:
                loss = loss + _draft_loss(model, res.draft)
            if not loss.requires_grad:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        score = worst_ratio()
        history[-1]["validation_worst_ratio"] = score
        if score > best_score:
            best_score, best_epoch, best_state = score, epoch, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    model.eval()
    report = {"train_batches": len(train), "validation_batches": len(check), "held_out_batches": len(val),
              "kept_epoch": best_epoch, "validation_worst_ratio": best_score, "history": history,
              "machines": [list(m) for m in MACHINES], "held_out": [], "flat": flat,
              "pass_seconds": base.pass_seconds, "cost_rows": base.cost.rows, "cost_seconds": base.cost.seconds}
    evaluate = val or train
    with torch.no_grad():
        for (slope, passes), m in zip(MACHINES, machines):
            row = {"row_slope": slope, "pass_cost": passes}
            row["heuristic"] = _summary(replay(policy_for_replay("heuristic"), evaluate, m, flat))
            if acceptance is not None:
                row["learned"] = _summary(replay(policy_for_replay("learned", acceptance=acceptance), evaluate, m, flat))
            row["rl"] = _summary(replay(policy_for_replay("rl", rl=model), evaluate, m, flat))
            report["held_out"].append(row)
        # on the recorded machine, by sampling temperature (every run has one)
        report["held_out_by_temperature"] = []
        for temp, subset in _by_temperature(evaluate).items():
            row = {"temperature": temp, "batches": len(subset)}
            for kind, pol in (("heuristic", policy_for_replay("heuristic")), ("rl", policy_for_replay("rl", rl=model))):
                row[kind] = _summary(replay(pol, subset, base, flat))
            if acceptance is not None:
                row["learned"] = _summary(replay(policy_for_replay("learned", acceptance=acceptance), subset, base, flat))
            report["held_out_by_temperature"].append(row)
    return model, report


def _temperature(run: list[dict]) -> float:
    return next((s["seqs"][0]["temperature"] for s in run if s["seqs"]), 0.0)


def _by_temperature(runs: list) -> dict[float, list]:
    """The runs grouped by their sampling temperature (every run has one), in order."""
    out: dict[float, list] = {}
    for r in runs:
        out.setdefault(_temperature(r), []).append(r)
    return dict(sorted(out.items()))


def write_reward_plot(report: dict, path: Path) -> None:
    """Training reward per epoch (as simulated speed over the heuristic's on the same steps
    and machine), the validation check, and the held-out comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    h = report["history"]
    a.plot([r["epoch"] for r in h], [r["speedup"] / r["heuristic_speedup"] for r in h], marker=".",
           label="training batches")
    if h and "validation_worst_ratio" in h[0]:
        a.plot([r["epoch"] for r in h], [r["validation_worst_ratio"] for r in h], marker=".",
               label="validation, worst temperature")
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_xlabel("epoch (the simulated machine changes each epoch)")
    a.set_ylabel("simulated speed / heuristic's")
    a.set_title(f"training (kept epoch: {report.get('kept_epoch', '-')}; -1 = untrained)", fontsize=9)
    a.legend(fontsize=8)
    rows = report["held_out"]
    labels = [f"rows x{r['row_slope']:g}\npasses x{r['pass_cost']:g}" for r in rows]
    kinds = [k for k in ("learned", "rl") if k in rows[0]]
    width = 0.8 / len(kinds)
    for j, k in enumerate(kinds):
        b.bar([i + j * width for i in range(len(rows))],
              [r[k]["speedup"] / r["heuristic"]["speedup"] - 1 for r in rows], width, label=k)
    b.axhline(0.0, color="grey", lw=0.8)
    b.set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(rows))], labels, fontsize=7)
    b.set_ylabel("simulated speed vs heuristic's - 1")
    b.set_title("held-out batches, per simulated machine", fontsize=9)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_rl_policy(cfg: PolicyTrainConfig) -> Path:
    """``sot train policy --kind rl``: traces (reused from ``out/traces.pt``), training,
    ``rl-policy.safetensors``, ``rl-report.json`` and ``rl-reward.png``."""
    from sot.policy.acceptance_model import load_acceptance_model
    from sot.train.acceptance import load_or_collect

    out = Path(cfg.out)
    traces = load_or_collect(cfg)
    acceptance = None
    try:
        acceptance = load_acceptance_model(None)
        if acceptance.info.get("embed_hash") != traces.get("embed_hash"):
            acceptance = None
    except ConfigError:
        acceptance = None
    model, report = train_rl(traces, cfg.rl_epochs, cfg.lr, cfg.seed, acceptance=acceptance)
    report["config"] = traces.get("config", {})
    if not all(math.isfinite(r["reward"]) for r in report["history"]):
        raise ConfigError("the training diverged (non-finite reward)")
    path = out / "rl-policy.safetensors"
    model.save(path, {"embed_hash": traces.get("embed_hash", ""), "drafter": "state",
                      "predictor": str(traces.get("config", {}).get("predictor") or "shipped"),
                      **({"predictor_hash": traces["predictor_hash"]} if traces.get("predictor_hash") else {})})
    (out / "rl-report.json").write_text(json.dumps(report, indent=1))
    write_reward_plot(report, out / "rl-reward.png")
    return path
