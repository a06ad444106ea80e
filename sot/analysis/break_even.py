"""What per-token acceptance a drafter needs, on this machine, for a given speed-up.

A greedy draft chain of ``d`` tokens, each accepted with probability ``a`` once its parent
was, commits ``1 + a + ... + a**d`` tokens per step (the bonus token included). The step costs
a verify pass of ``d + 1`` rows plus ``d`` drafter passes, against one one-row pass for a
plain token, so its speed over plain decoding is

    speed(a, d) = (1 + a + ... + a**d) * verify(1) / (verify(d + 1) + d * draft_pass)

The script measures ``verify`` with the engine's own cost model (every row count from 1 to
16, since the curve is not linear: it steps where a product no longer fits one register
tile). Passes timed back to back run faster than the same passes inside decoding, and this
machine's speed drifts, so only the curve's shape is taken from there: the script decodes a
few prompts plainly, scales the curve to the one-row pass timed there, and adds what a token
took beyond its pass (choosing and committing it). It times the state drafter's passes on the
same prompts and prints, for each target speed,
the smallest ``a`` that reaches it at the best depth: with the measured drafting cost and
with drafting counted as free. It also prints the speed each ``a`` allows. Trees of the same
size do a little better than chains where the drafter's second choice is often right.

    python -m sot.analysis.break_even --prompts humaneval --limit 3
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

from sot.policy.cost import best_speed, chain_speed


def required_acceptance(target: float, verify: Callable[[int], float], draft_pass: float,
                        max_depth: int = 12) -> tuple[float, int]:
    """The smallest per-token acceptance for which some chain depth ``1..max_depth`` reaches
    ``target`` times plain speed, and that depth. ``(inf, 0)`` when no depth can, even
    at acceptance 1."""
    best = (float("inf"), 0)
    for depth in range(1, max_depth + 1):
        if chain_speed(1.0, depth, verify, draft_pass) < target:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(50):  # speed rises with a: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if chain_speed(mid, depth, verify, draft_pass) < target else (lo, mid)
        if hi < best[0]:
            best = (hi, depth)
    return best


def _plain_decoding(sot, prompts: list, tokens: int) -> tuple[float, float]:
    """Plain decoding (the engine without a drafter) of ``prompts``: the mean seconds per token
    after the first (the prompt's prefill is no decoding step) and the mean seconds of the
    target's one-row pass in it."""
    from sot.drafters import DrafterKind, make_drafter
    from sot.engine import Engine

    target = sot.engine.target
    passes: list[float] = []
    verify = target.verify

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = verify(*args, **kwargs)
        out.logits  # (the one row's logits, which the walk reads: the cost curve times them too)
        passes.append(time.perf_counter() - t0)
        return out

    plain = Engine(target, make_drafter(DrafterKind.NONE), sot.engine.budget)
    target.verify = timed
    try:
        results = [plain.generate([sot.encode(item)], sot.params(max_new_tokens=tokens))[0] for item in prompts]
    finally:
        target.verify = verify
    per_token = sum(r.seconds - r.first_token_seconds for r in results) / sum(len(r.token_ids) - 1 for r in results)
    return per_token, sum(passes) / len(passes)  # (the prompt is read by prefill, not timed here)


def _draft_pass_seconds(sot, prompts: list, tokens: int) -> float:
    """Mean seconds per predictor pass while the state drafter decodes ``prompts``."""
    drafter = sot.engine.drafter
    spent, passes = [], []
    propose = drafter.propose

    def timed(inputs, budget):
        before, t0 = drafter.passes, time.perf_counter()
        out = propose(inputs, budget)
        spent.append(time.perf_counter() - t0)
        passes.append(drafter.passes - before)
        return out

    drafter.propose = timed
    try:
        for item in prompts:
            sot.engine.generate([sot.encode(item)], sot.params(max_new_tokens=tokens))
    finally:
        drafter.propose = propose
    return sum(spent) / max(1, sum(passes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", default="humaneval", help="prompt set whose decoding times the drafter")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--speeds", default="1.5,2.0", help="target speed-ups over plain decoding")
    args = ap.parse_args()
    if args.max_new_tokens < 2 or args.limit < 1:
        ap.error("--max-new-tokens must be >= 2 (the first token is the prompt's) and --limit >= 1")

    from sot import SoT
    from sot.bench.prompts import load_prompt_set
    from sot.policy import CostModel

    sot = SoT.load(args.model, drafter="state")
    prompts = load_prompt_set(args.prompts, limit=args.limit)
    cost = CostModel.measure(sot.engine.target, 64, sizes=list(range(1, 17)) + [24, 32, 48, 64])
    print("verify ms by rows, back to back:", ", ".join(f"{n}: {cost.verify(n) * 1000:.1f}" for n in range(1, 17)))
    plain, one_row = _plain_decoding(sot, prompts, args.max_new_tokens)
    print(f"plain decoding: {plain * 1000:.1f} ms per token, its pass {one_row * 1000:.1f} ms")
    draft = _draft_pass_seconds(sot, prompts, args.max_new_tokens)
    print(f"state drafter: {draft * 1000:.2f} ms per predictor pass (mean over {args.limit} prompts)")

    def step(rows: int) -> float:  # a decoding step's seconds with a pass of ``rows`` rows
        return one_row * cost.verify(rows) / cost.verify(1) + (plain - one_row)

    for label, seconds in (("measured drafting", draft), ("free drafting", 0.0)):
        for target in (float(s) for s in args.speeds.split(",")):
            a, depth = required_acceptance(target, step, seconds)
            need = "out of reach" if depth == 0 else f"per-token acceptance >= {a:.3f} (chain of {depth})"
            print(f"{label}, {target:.2f}x plain: {need}")
    print("speed over plain by per-token acceptance (measured drafting / free):")
    for a in (0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9):
        (s1, d1), (s0, d0) = best_speed(a, step, draft), best_speed(a, step, 0.0)
        print(f"  a = {a:.2f}: {s1:.2f}x (depth {d1}) / {s0:.2f}x (depth {d0})")


if __name__ == "__main__":
    main()
