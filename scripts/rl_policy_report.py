"""Summarise the rl commit-policy comparison written by scripts/bench_rl_policy.sh.

    python scripts/rl_policy_report.py docs/bench/rl-policy    # writes SUMMARY.md, prints it
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = (("sharegpt-heldout", "ShareGPT held-out, greedy"), ("humaneval", "HumanEval, greedy"),
        ("adversarial", "adversarial, greedy"), ("sharegpt-t1", "ShareGPT held-out, temperature 1.0"),
        ("batch4-mix", "mix, continuous batch of 4"))
POLICIES = ("heuristic", "learned", "rl")


def rows(root: Path) -> list[str]:
    out = ["| set | policy | tok/s | vs plain | vs heuristic | tau | verified rows per step | steps without the predictor | "
           "identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
    for folder, label in SETS:
        f = root / folder / "results.json"
        if not f.is_file():
            out.append(f"| {label} | not run | | | | | | | |")
            continue
        methods = json.loads(f.read_text())["methods"]
        plain = methods["plain"]["tokens_per_s"]
        heuristic = methods.get("state[heuristic]", {}).get("tokens_per_s")
        for p in POLICIES:
            m = methods.get(f"state[{p}]")
            if m is None:
                continue
            vs_h = f"{m['tokens_per_s'] / heuristic:.3f}x" if heuristic else "-"
            out.append(f"| {label} | `{p}` | {m['tokens_per_s']:.1f} | {m['tokens_per_s'] / plain:.2f}x | {vs_h} | "
                       f"{m['mean_accept_len'] or 0:.2f} | {m['mean_tree_size'] or 0:.1f} | "
                       f"{m['plain_step_share'] or 0:.0%} | {m.get('identical_to_plain') or '-'} |")
    return out


def training_lines(root: Path) -> list[str]:
    f = root / "train" / "rl-report.json"
    if not f.is_file():
        return []
    rep = json.loads(f.read_text())
    out = ["", f"Simulated, held-out batches ({rep['held_out_batches']} of {rep['held_out_batches'] + rep['train_batches']}), "
           "speed-up over plain on the same steps:", "",
           "| machine (row cost, pass cost) | heuristic | learned | rl |", "|---|---|---|---|"]
    for r in rep["held_out"]:
        cells = [f"{r[k]['speedup']:.3f}x" if k in r else "-" for k in POLICIES]
        out.append(f"| x{r['row_slope']:g}, x{r['pass_cost']:g} | " + " | ".join(cells) + " |")
    out += ["", "On the recorded machine, by temperature:", "", "| temperature | batches | heuristic | learned | rl |",
            "|---|---|---|---|---|"]
    for r in rep.get("held_out_by_temperature", []):
        cells = [f"{r[k]['speedup']:.3f}x" if k in r else "-" for k in POLICIES]
        out.append(f"| {r['temperature']:g} | {r['batches']} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    args = ap.parse_args()
    text = "\n".join(["# heuristic, learned and rl commit policies", "", *rows(args.root), *training_lines(args.root)])
    (args.root / "SUMMARY.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
