"""The summary table of scripts/bench_batches.sh: state against plain by prompt set and
batch size, with the commit policy's telemetry, read from each run's results.json.

Usage: python scripts/batch_table.py OUT_DIR SET [SET ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path, sets: list[str]) -> list[str]:
    lines = ["| set | batch | modes (plain / state) | plain tok/s | state tok/s | state vs plain | tau | "
             "rows per sequence | sequence steps the predictor drafted | draft time | identical to alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in sets:
        found = sorted(out.glob(f"{name}-b*/results.json"), key=lambda p: int(p.parent.name.rsplit("-b", 1)[1]))
        for path in found:
            result = json.loads(path.read_text())
            methods, config = result["methods"], result["config"]
            plain, state = methods["plain"], methods["state"]
            # (--dtype auto picks each method's mode; results from before name one for both)
            modes = config.get("method_dtypes") or {"plain": config["dtype"], "state": config["dtype"]}
            drafting = 1.0 - (state["plain_step_share"] or 0.0)
            lines.append(
                f"| {name} | {path.parent.name.rsplit('-b', 1)[1]} | {modes['plain']} / {modes['state']} | "
                f"{plain['tokens_per_s']:.1f} | "
                f"{state['tokens_per_s']:.1f} | {state['tokens_per_s'] / plain['tokens_per_s']:.2f}x | "
                f"{state['mean_accept_len']:.2f} | {state['mean_tree_size']:.2f} | {100 * drafting:.0f}% | "
                f"{100 * state['phase_share'].get('draft', 0):.0f}% | {state.get('identical_to_alone') or '-'} |")
    return lines


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    lines = rows(out, sys.argv[2:])
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
