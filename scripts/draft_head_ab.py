"""The state predictor's draft head read from the target head's GGUF blocks against oneDNN's
product over its bfloat16 rows, side by side in one process (batch 1, greedy, bfloat16).

Two engines over the default model, one with the draft head re-packed for oneDNN; the prompts
alternate which engine runs first. Prints tokens/s, tau, the drafting time and the median
predictor pass of each, and whether their answers are equal.

    python scripts/draft_head_ab.py --n 12 --fallback-threshold 0   # the predictor drafts every step
    python scripts/draft_head_ab.py --n 12                          # the default policy
"""
from __future__ import annotations

import argparse
import statistics
import time


def load(blocks: bool, threshold: float):
    from sot import SoT
    from sot.kernels.linear import BF16_BLOCKS_ATTR, PackedLinear
    from sot.policy import PolicyConfig

    sot = SoT.load("default", drafter="state", dtype="bfloat16", policy=PolicyConfig(fallback_threshold=threshold))
    predictor = sot.engine.drafter.predictor
    if not blocks:
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
    args = ap.parse_args()
    sots = {"onednn": load(False, args.fallback_threshold), "blocks": load(True, args.fallback_threshold)}
    for name, sot in sots.items():
        head = sot.engine.drafter.predictor._packed["head"]
        print(f"{name}: draft head kernel {head.kind}, blocks {head.bf16_blocks}")
    records = load_prompt_set(args.set, limit=args.n)
    first = sots["blocks"]
    prompts = [first.encode(r["turns"][0] if r.get("turns") else r["prompt"]) for r in records]
    stat = {v: [0, 0.0, 0, 0.0, []] for v in sots}
    for i, prompt in enumerate(prompts):
        for v in (list(sots) if i % 2 == 0 else list(sots)[::-1]):
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
    print("answers equal:", stat["onednn"][4] == stat["blocks"][4])


if __name__ == "__main__":
    main()
