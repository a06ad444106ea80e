"""A session of prompts from one domain, in order: plain decoding, the frozen predictor and the
predictor with test-time adaptation (``--adapt``), side by side on every prompt (the order of
the three rotates from prompt to prompt). Reports tokens/s over the session, tau over its last
16 prompts, whether every output equals plain decoding's, and what the adapter did.

Usage: .venv/bin/python scripts/adapt_session.py --prompts humaneval --limit 64 --out DIR
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from sot.api import SoT
from sot.bench.prompts import load_prompt_set
from sot.online.adapt import AdaptConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--predictor", default=None)
    ap.add_argument("--budget", type=float, default=AdaptConfig.budget)
    ap.add_argument("--tail", type=int, default=16, help="prompts at the end whose tau is compared")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/session.png from OUT/session.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((Path(args.out) / "session.json").read_text()), Path(args.out) / "session.png", args.tail)
        return
    methods = {"plain": SoT.load(drafter="none"),
               "frozen": SoT.load(predictor=args.predictor),
               "adapt": SoT.load(predictor=args.predictor, adapt=AdaptConfig(budget=args.budget))}
    items = load_prompt_set(args.prompts, limit=args.limit)
    rows = {m: [] for m in methods}
    names = list(methods)
    for i, item in enumerate(tqdm(items, desc=f"session {args.prompts}", unit="prompt")):
        for m in names[i % 3:] + names[: i % 3]:
            sot = methods[m]
            ids = sot.encode(item)
            params = sot.params(max_new_tokens=args.max_new_tokens)
            t0 = time.perf_counter()
            r = sot.generate_ids([ids], params)[0]
            seconds = time.perf_counter() - t0
            rows[m].append({"tokens": r.new_tokens, "seconds": seconds, "steps": r.steps, "ids": r.token_ids})
    report = {"prompts": args.prompts, "count": len(items), "max_new_tokens": args.max_new_tokens,
              "adapter": methods["adapt"].adapter.stats(), "methods": {}}
    plain_ids = [r["ids"] for r in rows["plain"]]
    for m, rs in rows.items():
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        tail = rs[-args.tail:]
        report["methods"][m] = {
            "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "tau_all": _tau(rs), "tau_tail": _tau(tail),
            "identical_to_plain": [r["ids"] for r in rs] == plain_ids,
            "tau_per_prompt": [r["tokens"] / r["steps"] if r["steps"] else None for r in rs],
        }
    f, a = report["methods"]["frozen"], report["methods"]["adapt"]
    report["adapt_vs_frozen"] = {"tok_s": a["tok_s"] / f["tok_s"], "tau_tail": a["tau_tail"] / f["tau_tail"],
                                 "tau_all": a["tau_all"] / f["tau_all"],
                                 "plain_tok_s_ratio": {m: report["methods"][m]["tok_s"] / report["methods"]["plain"]["tok_s"]
                                                       for m in ("frozen", "adapt")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "session.png", args.tail)
    print(json.dumps({k: v for k, v in report.items() if k != "methods"}, indent=2))
    for m, v in report["methods"].items():
        print(f"{m:7s} {v['tok_s']:.1f} tok/s  tau {v['tau_all']:.3f} (last {args.tail}: {v['tau_tail']:.3f})  "
              f"identical to plain: {v['identical_to_plain']}")


def plot(report: dict, path: Path, tail: int) -> None:
    """Tau per prompt (a moving mean over 8 prompts) of the frozen and the adapted predictor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for m in ("frozen", "adapt"):
        taus = [t or 0.0 for t in report["methods"][m]["tau_per_prompt"]]
        smooth = [sum(taus[max(0, i - 7): i + 1]) / len(taus[max(0, i - 7): i + 1]) for i in range(len(taus))]
        ax.plot(range(1, len(taus) + 1), smooth, label=f"{m} (last {tail}: {report['methods'][m]['tau_tail']:.3f})")
    ax.axvspan(len(taus) - tail + 0.5, len(taus) + 0.5, color="grey", alpha=0.12)
    ax.set_xlabel("prompt, in session order")
    ax.set_ylabel("tokens per step (mean of the last 8 prompts)")
    ax.set_title(f"{report['prompts']}: adapt {report['adapt_vs_frozen']['tok_s']:.2f}x frozen tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _tau(rows: list[dict]) -> float:
    steps = sum(r["steps"] or 0 for r in rows)
    return sum(r["tokens"] for r in rows) / steps if steps else 0.0


if __name__ == "__main__":
    main()
