"""Summarise the commit-policy study written by scripts/bench_policy.sh.

    python scripts/policy_report.py docs/bench/policy                 # writes SUMMARY.md, depth-sweep.png
    python scripts/policy_report.py --best-static docs/bench/policy   # prints "WIDTH DEPTH"
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: Path) -> dict | None:
    f = path / "results.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _total_vs_plain(res: dict, method: str = "state") -> float:
    return res["methods"][method]["tokens_per_s"] / res["methods"]["plain"]["tokens_per_s"]


def static_rows(root: Path) -> list[tuple[int, int, float, float]]:
    """(width, depth, total tokens/s vs plain, tau) of every static setting measured."""
    rows = []
    for d in sorted(root.glob("static-w*")):
        res = _load(d)
        if not res or "sweep" not in res:
            continue
        width = int(d.name.removeprefix("static-w"))
        for r in res["sweep"]["rows"]:
            rows.append((width, r["value"], r["tokens_per_s_vs_plain"], r["mean_accept_len"]))
    return rows


def best_static(root: Path) -> tuple[int, int]:
    rows = static_rows(root)
    if not rows:
        raise SystemExit(f"no static sweeps under {root}")
    w, d, _, _ = max(rows, key=lambda r: r[2])
    return w, d


def _line(name: str, res: dict | None) -> str:
    if not res:
        return f"| {name} | not run | | | | | |"
    s = res["methods"]["state"]
    med = s["speedup_vs_plain"] or {}
    return (f"| {name} | {_total_vs_plain(res):.2f}x | {med.get('median', 0):.2f}x ({med.get('min', 0):.2f}-"
            f"{med.get('max', 0):.2f}) | {s['mean_accept_len'] or 0:.2f} | {s['mean_tree_size'] or 0:.1f} | "
            f"{s['plain_step_share'] or 0:.0%} | {s.get('identical_to_plain') or '-'} |")


def depth_plot(root: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    drawn = False
    for name in ("sharegpt-heldout", "humaneval"):
        res = _load(root / f"depth-{name}")
        if not res or "sweep" not in res:
            continue
        rows = res["sweep"]["rows"]
        xs = [r["value"] for r in rows]
        ax[0].plot(xs, [r["tokens_per_s_vs_plain"] for r in rows], marker="o", label=name)
        ax[1].plot(xs, [r["mean_accept_len"] for r in rows], marker="s", label=name)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    ax[0].set_xlabel("--max-depth")
    ax[0].set_ylabel("tokens/s vs plain")
    ax[1].set_xlabel("--max-depth")
    ax[1].set_ylabel("tau")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(root / "depth-sweep.png", dpi=120)
    plt.close(fig)
    return "depth-sweep.png"


def summary(root: Path) -> str:
    head = ["| run | tok/s vs plain (total) | per prompt (median, range) | tau | tree size | plain steps | identical |",
            "|---|---|---|---|---|---|---|"]
    lines = ["# Commit-policy study", "", "Made by `scripts/bench_policy.sh`; `state` against `plain` in each run.", ""]
    lines += ["## Policies", ""] + head
    for name in ("sharegpt-heldout-heuristic", "sharegpt-heldout-learned", "sharegpt-heldout-static",
                 "humaneval-heuristic", "humaneval-learned"):
        lines.append(_line(name, _load(root / name)))
    lines += ["", "## Unpredictable workloads (adversarial greedy; t1.5: temperature 1.5 with coupled sampling)", ""] + head
    for name in ("adversarial-heuristic", "adversarial-learned", "adversarial-t1.5-heuristic",
                 "adversarial-t1.5-learned", "sharegpt-t1.5-heuristic", "sharegpt-t1.5-learned"):
        lines.append(_line(name, _load(root / name)))
    batch = _load(root / "batch4-mix")
    lines += ["", "## Batch of 4 (mix of ShareGPT and adversarial prompts)", ""] + head + [_line("batch4-mix", batch)]
    if batch:
        lines.append("")
        lines.append(f"Each sequence equals its prompt decoded alone: state {batch['methods']['state'].get('identical_to_alone')}, "
                     f"plain {batch['methods']['plain'].get('identical_to_alone')}.")
    rows = static_rows(root)
    if rows:
        lines += ["", "## Static trees (width x depth, ShareGPT held-out)", "",
                  "| width | depth | nodes | tok/s vs plain | tau |", "|---|---|---|---|---|"]
        for w, d, r, t in sorted(rows):
            lines.append(f"| {w} | {d} | {1 + w * d} | {r:.2f}x | {t:.2f} |")
    for name in ("sharegpt-heldout", "humaneval"):
        res = _load(root / f"depth-{name}")
        if res and "sweep" in res:
            lines += ["", f"## Depth sweep, {name} (dynamic policy)", "",
                      "| max depth | tok/s vs plain | tau | tree size | identical |", "|---|---|---|---|---|"]
            for r in res["sweep"]["rows"]:
                lines.append(f"| {r['value']} | {r['tokens_per_s_vs_plain']:.2f}x | {r['mean_accept_len']:.2f} | "
                             f"{r.get('mean_tree_size') or 0:.1f} | {r['identical_to_plain']} |")
    res = _load(root / "warmup")
    if res and "sweep" in res:
        lines += ["", "## Warm-up (tokens decoded plainly first), ShareGPT held-out", "",
                  "| warm-up | tok/s vs plain | tau |", "|---|---|---|"]
        for r in res["sweep"]["rows"]:
            lines.append(f"| {r['value']} | {r['tokens_per_s_vs_plain']:.2f}x | {r['mean_accept_len']:.2f} |")
    fit = root / "learned-fit" / "report.json"
    if fit.is_file():
        rep = json.loads(fit.read_text())
        ll = rep["val_log_loss"]
        lines += ["", "## The learned acceptance model", "",
                  f"{rep['nodes']:,} logged nodes ({rep['accept_rate']:.1%} accepted); held-out log-loss: learned "
                  f"{ll['learned']:.3f}, heuristic (calibrated confidence) {ll['heuristic']:.3f}. "
                  "![calibration](learned-fit/calibration.png)"]
    plot = depth_plot(root)
    if plot:
        lines += ["", f"![depth sweep]({plot})"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("root", type=Path)
    ap.add_argument("--best-static", action="store_true", help="print the best static width and depth")
    args = ap.parse_args()
    if args.best_static:
        print(*best_static(args.root))
        return
    (args.root / "SUMMARY.md").write_text(summary(args.root))
    print(f"wrote {args.root / 'SUMMARY.md'}")


if __name__ == "__main__":
    main()
