"""Why a batch drafts or not: the commit policy's view of one offline run, step by step.

Decodes a prompt set at one batch size with the state drafter (the adaptive policy, as
`sot bench` runs it) and records what the batch planning weighed at every step:

- open batches (prompts still waiting), planned by tokens per second
  (`CommitPolicy.worth_drafting`): how many sequences wanted to draft, how many were
  chosen, and the modelled rate of the best choice against a root-only step's;
- closed batches planned for their end (`CommitPolicy.critical_path`): how many
  sequences were offered drafts and how many were allowed to speculate;
- every drafting call: its sequences, passes and time per pass;
- the verify cost curve at the batch's row counts.

    python scripts/planner_view.py --set sharegpt-heldout --limit 16 --batch-size 4

Where the predictor stays idle, the "best / root-only" column says by how much a drafting
step misses, and the call and curve figures say which cost to cut.
"""
from __future__ import annotations

import argparse
import collections
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="sharegpt-heldout", help="a built-in prompt set (sot bench --prompts)")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()

    from sot.api import SoT
    from sot.bench.prompts import load_prompt_set
    from sot.dtype_choice import resolve

    dtype = resolve(args.dtype, args.model, "state", batch=args.batch_size).dtype  # (auto: as sot bench at this size)
    sot = SoT.load(args.model, drafter="state", dtype=dtype)
    prompts = [sot.encode(r["turns"][0] if "turns" in r else r) for r in load_prompt_set(args.set, limit=args.limit)]
    policy = sot.engine.policy
    opened: list[tuple[int, int, int, float | None]] = []  # (batch, wanting, chosen, best rate / root-only rate)
    closed: list[tuple[int, int, int]] = []  # (batch, offered, allowed)
    calls: list[tuple[int, int, float]] = []  # (drafting sequences, passes, seconds)
    worth, critical, observe = policy.worth_drafting, policy.critical_path, policy.observe_step

    def worth_drafting(drafting, batch_rows):
        chosen = worth(drafting, batch_rows)
        ratio = None
        if drafting and len(policy.pass_seconds) >= 3:
            plain_rate, ranked = policy.drafting_rates(drafting, batch_rows)
            ratio = max(rate for _, rate in ranked) / plain_rate
        opened.append((batch_rows, len(drafting), len(chosen), ratio))
        return chosen

    def critical_path(left, drafting, free):
        allowed = critical(left, drafting, free)
        closed.append((len(left), len(drafting) + len(free), len(allowed)))
        return allowed

    def observe_step(plan, outcome):
        if plan.drafting:
            calls.append((len(plan.drafting), outcome.draft_passes, outcome.draft_seconds))
        return observe(plan, outcome)

    policy.worth_drafting, policy.critical_path, policy.observe_step = worth_drafting, critical_path, observe_step
    results = sot.generate_ids(prompts, sot.params(max_new_tokens=args.tokens), batch_size=args.batch_size)
    tokens = sum(len(r.token_ids) for r in results)
    print(f"model {args.model}, {sot.engine.target.dtype}, {args.set} x {len(prompts)}, {args.tokens} tokens, "
          f"batch {args.batch_size}: {tokens} tokens")

    cost = policy.cost
    b = args.batch_size
    print(f"\nverify curve (ms): {b} rows {cost.verify(b) * 1e3:.2f}; "
          + "; ".join(f"+{k} {cost.verify(b + k) * 1e3:.2f}" for k in (1, 2, 4, 8, 16)))

    print("\nopen batches (tokens per second planning):")
    print("| batch | steps | wanting to draft (median) | chosen (median) | steps drafting "
          "| best / root-only (median) |")
    print("|---|---|---|---|---|---|")
    for size in sorted({o[0] for o in opened}, reverse=True):
        rows = [o for o in opened if o[0] == size]
        ratios = [o[3] for o in rows if o[3] is not None]
        ratio = f"{statistics.median(ratios):.3f}" if ratios else "-"
        print(f"| {size} | {len(rows)} | {statistics.median(o[1] for o in rows):.0f} | "
              f"{statistics.median(o[2] for o in rows):.0f} | {sum(o[2] > 0 for o in rows)} | {ratio} |")

    print("\nclosed batches (planned for their end):")
    print("| batch | steps | offered (median) | allowed (median) | steps speculating |")
    print("|---|---|---|---|---|")
    for size in sorted({c[0] for c in closed}, reverse=True):
        rows = [c for c in closed if c[0] == size]
        print(f"| {size} | {len(rows)} | {statistics.median(c[1] for c in rows):.0f} | "
              f"{statistics.median(c[2] for c in rows):.0f} | {sum(c[2] > 0 for c in rows)} |")

    print("\ndrafting calls (after the first three, which read prompts):")
    print("| drafting sequences | calls | passes (median) | ms a pass (median) | ms a call (median) |")
    print("|---|---|---|---|---|")
    by = collections.defaultdict(list)
    for n, passes, seconds in calls[3:]:
        by[n].append((passes, seconds))
    for n in sorted(by):
        rows = by[n]
        print(f"| {n} | {len(rows)} | {statistics.median(p for p, _ in rows):.0f} | "
              f"{statistics.median(s / max(p, 1) for p, s in rows) * 1e3:.2f} | "
              f"{statistics.median(s for _, s in rows) * 1e3:.2f} |")
    print(f"\nthe planner's figures at the end: a pass {statistics.median(policy.pass_seconds) * 1e3:.2f} ms, "
          f"{policy.passes_per_call:.1f} passes a call")


if __name__ == "__main__":
    main()
