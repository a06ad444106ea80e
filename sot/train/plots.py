"""The trainer's plots: its loss curves and held-out acceptance by depth."""
from __future__ import annotations

from pathlib import Path


def write_plots(out: Path, history: list[dict], evals: list[dict]) -> None:
    """``loss.png`` (training loss and per-step CE) and ``accept.png`` (per-depth acceptance)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if history:
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [h["step"] for h in history]
        ax.plot(steps, [h["loss"] for h in history], label="total loss", color="black")
        for k in range(len([key for key in history[0] if key.startswith("kl")])):
            ax.plot(steps, [h[f"kl{k}"] for h in history], label=f"KL to target, unroll step {k}", alpha=0.7)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_title("state predictor training loss")
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=110)
        plt.close(fig)
    if evals:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        last = evals[-1]
        a1.bar(range(1, len(last["accept_rate"]) + 1), last["accept_rate"], color="tab:blue", label="given depth d-1 reached")
        a1.plot(range(1, len(last["reach"]) + 1), last["reach"], "o-", color="tab:red", label="reached")
        a1.set_xlabel("draft depth")
        a1.set_ylabel("greedy acceptance")
        a1.set_ylim(0, 1)
        a1.legend(fontsize=8)
        a1.set_title(f"held-out, step {last['step']}")
        a2.plot([e["step"] for e in evals], [e["chain_tau"] for e in evals], "o-")
        a2.set_xlabel("optimizer step")
        a2.set_ylabel("expected tokens per step (one chain)")
        a2.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "accept.png", dpi=110)
        plt.close(fig)
