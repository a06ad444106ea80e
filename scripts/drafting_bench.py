"""What one drafting call of the state predictor costs, and where its time goes.

Decodes prompts with the state drafter and a policy that drafts on every step (``static``,
the full predictor budget) at each batch size given, and times every drafting call: its
reading of the target states committed since the sequence last drafted ("absorb"), the
rest of the call (the tree's passes, "grow"), and within the call the predictor's products
(its layers and its head over the draft vocabulary), the attention over each sequence's
predictor cache and the ranking of each node's children, against everything else. The figures
say whether a drafting call is bound by the products (then the head's bytes and row count
matter) or by per-pass and per-sequence overhead (then Python and small kernels do):

    python scripts/drafting_bench.py --batch-sizes 1,4,8 --limit 8

Drafting on every step is not what the adaptive policy does; it shows the call's cost at the
row counts a full budget reaches. One generation runs at a time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="sharegpt-heldout", help="a built-in prompt set (sot bench --prompts)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()

    from sot.api import SoT
    from sot.bench.prompts import load_prompt_set

    sot = SoT.load(args.model, drafter="state", dtype=args.dtype, policy="static")
    records = load_prompt_set(args.set, limit=args.limit)
    prompts = [sot.encode(r["turns"][0] if "turns" in r else r) for r in records]
    drafter = sot.engine.drafter
    predictor = drafter.predictor
    packed = predictor.__dict__.get("_packed") or {}
    timed = {"products": 0.0, "head": 0.0}

    def timing(name: str, lin):
        block = lin._block

        def run(x: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            out = block(x)
            spent = time.perf_counter() - t
            timed["products"] += spent
            if name == "head":
                timed["head"] += spent
            return out
        return run

    for name, lin in packed.items():
        lin._block = timing(name, lin)

    import sot.drafters.state.drafter as drafter_module

    def timed_piece(label: str, fn):  # the attention over each sequence's cache, the children
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            timed[label] += time.perf_counter() - t
            return out
        return run

    timed["attention"] = timed["children"] = 0.0
    drafter_module._SeqState.attend = timed_piece("attention", drafter_module._SeqState.attend)
    drafter_module.top_log_softmax = timed_piece("children", drafter_module.top_log_softmax)
    calls: list[tuple[float, float, int, int, int, float, float, float, float]] = []
    absorb_inputs, propose = drafter._absorb_inputs, drafter.propose
    current: dict[str, float] = {}

    def absorbing(inputs):
        t = time.perf_counter()
        absorb_inputs(inputs)
        current["absorb"] = time.perf_counter() - t

    def proposing(inputs, budget):
        current.clear()
        for key in timed:
            timed[key] = 0.0
        passes, start = drafter.passes, time.perf_counter()
        out = propose(inputs, budget)
        calls.append((time.perf_counter() - start, current.get("absorb", 0.0), len(inputs), drafter.passes - passes,
                      sum(tree.size - 1 for tree in out), timed["products"], timed["head"], timed["attention"],
                      timed["children"]))
        return out

    drafter._absorb_inputs, drafter.propose = absorbing, proposing
    print(f"model {args.model}, {sot.engine.target.dtype}, {args.set} x {len(prompts)}, {args.tokens} tokens, "
          f"policy static; per drafting call (medians; ms):")
    print("| batch | calls | call | absorb | grow | grow per pass | products | head | attention | children | passes "
          "| drafted nodes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        calls.clear()
        sot.generate_ids(prompts, sot.params(max_new_tokens=args.tokens), batch_size=batch)
        steady = calls[3:] or calls  # (the first calls read whole prompts)

        def med(i: int) -> float:
            return statistics.median(c[i] for c in steady) * 1e3

        grow = [(c[0] - c[1]) * 1e3 for c in steady]
        per_pass = [(c[0] - c[1]) * 1e3 / max(1, c[3] - 1) for c in steady]
        print(f"| {batch} | {len(calls)} | {med(0):.2f} | {med(1):.2f} | {statistics.median(grow):.2f} | "
              f"{statistics.median(per_pass):.2f} | {med(5):.2f} | {med(6):.2f} | {med(7):.2f} | {med(8):.2f} | "
              f"{statistics.median(c[3] for c in steady):.0f} | {statistics.median(c[4] for c in steady):.0f} |")


if __name__ == "__main__":
    main()
