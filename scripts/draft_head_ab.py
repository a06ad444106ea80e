"""How the state predictor's products are read, side by side in one process (batch 1,
greedy, bfloat16): ``onednn`` (bfloat16 weights and draft head through oneDNN, as before),
``head`` (the draft head read from the target head's GGUF blocks) and ``q8`` (that, and the
predictor's own weights rounded to Q8_0 blocks for the block kernel: the default).

One engine per variant over the default model; the prompts rotate which engine runs first.
Prints tokens/s, tau, the drafting time and the median predictor pass of each, and how many
answers equal the first variant's (all must: drafts never change the output).

    python scripts/draft_head_ab.py --n 12 --fallback-threshold 0   # the predictor drafts every step
    python scripts/draft_head_ab.py --n 12                          # the default policy
"""
from __future__ import annotations

import argparse
import statistics
import time


def load(variant: str, threshold: float):
    from sot import SoT
    from sot.drafters.state.model import StatePredictor
    from sot.kernels.linear import BF16_BLOCKS_ATTR, PackedLinear
    from sot.policy import PolicyConfig

    StatePredictor.q8_0_weights = variant == "q8"
    try:
        sot = SoT.load("default", drafter="state", dtype="bfloat16", policy=PolicyConfig(fallback_threshold=threshold))
    finally:
        StatePredictor.q8_0_weights = True
    predictor = sot.engine.drafter.predictor
    if variant == "onednn":
        if hasattr(predictor.head, BF16_BLOCKS_ATTR):
            delattr(predictor.head, BF16_BLOCKS_ATTR)
        predictor._packed["head"] = PackedLinear(predictor.head)
    sot.generate_ids([sot.encode("Hello")], sot.params(max_new_tokens=16))  # untimed: kernels, cost curve
    return sot


def main() -> None:
    from sot.bench.prompts import load_prompt_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="sharegpt-heldout")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--fallback-threshold", type=float, default=1.0)
    ap.add_argument("--variants", default="onednn,head,q8")
    args = ap.parse_args()
    sots = {v: load(v, args.fallback_threshold) for v in args.variants.split(",")}
    for name, sot in sots.items():
        head = sot.engine.drafter.predictor._packed["head"]
        print(f"{name}: draft head kernel {head.kind}, blocks {head.bf16_blocks}")
    records = load_prompt_set(args.set, limit=args.n)
    variants = list(sots)
    first = sots[variants[0]]
    prompts = [first.encode(r["turns"][0] if r.get("turns") else r["prompt"]) for r in records]
    stat = {v: [0, 0.0, 0, 0.0, []] for v in sots}
    for i, prompt in enumerate(prompts):
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            sot = sots[v]
            drafted = sot.engine.times.draft
            t0 = time.perf_counter()
            out = sot.generate_ids([prompt], sot.params(max_new_tokens=args.max_new_tokens))[0]
            st = stat[v]
            st[0] += len(out.token_ids)
            st[1] += time.perf_counter() - t0
            st[2] += out.steps
            st[3] += sot.engine.times.draft - drafted
            st[4].append(out.token_ids)
    for v, (tokens, seconds, steps, draft, _) in stat.items():
        passes = sots[v].engine.policy.pass_seconds
        median = f"{statistics.median(passes) * 1e3:.2f} ms" if passes else "-"
        print(f"{v}: {tokens / seconds:.1f} tok/s, tau {tokens / max(steps, 1):.2f}, drafting {draft:.2f} s of "
              f"{seconds:.2f} s, predictor pass {median}")
    same = {v: sum(a == b for a, b in zip(stat[v][4], stat[variants[0]][4])) for v in variants}
    print("answers equal to the first variant's: " + ", ".join(f"{v} {n}/{len(prompts)}" for v, n in same.items()))


if __name__ == "__main__":
    main()
