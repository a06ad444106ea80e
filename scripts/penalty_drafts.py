"""Drafts that follow a request's penalties, against drafts that ignore them: the default model,
``--drafter state``, ShareGPT held-out prompts, greedy, alternating rounds in one process (the
drafter's ``follow_rules`` switched between them; what is verified and committed is the same
either way, which the script checks). Prints tokens/s and tau per rule set.

    python scripts/penalty_drafts.py [--prompts 4] [--rounds 3] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

from sot import SoT
from sot.bench.prompts import load_prompt_set

RULES = {
    "repetition 1.2 + frequency 0.3": dict(repetition_penalty=1.2, frequency_penalty=0.3),
    "presence 0.6": dict(presence_penalty=0.6),
    "frequency 0.8": dict(frequency_penalty=0.8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    sot = SoT.load("default", drafter="state", prefix_cache_mb=0)
    drafter = sot.engine.drafter
    prompts = [sot.encode(p) for p in load_prompt_set("sharegpt-heldout", limit=args.prompts)]
    sot.generate_ids(prompts[:1], sot.params(max_new_tokens=16))  # warm-up
    for label, rules in RULES.items():
        params = sot.params(max_new_tokens=args.max_new_tokens, **rules)
        speeds: dict[bool, list[float]] = {True: [], False: []}
        taus: dict[bool, list[float]] = {True: [], False: []}
        answers: dict[bool, list[list[int]]] = {}
        for _ in range(args.rounds):
            for follow in (True, False):
                drafter.follow_rules = follow
                t0 = time.perf_counter()
                out = sot.generate_ids(prompts, params)
                seconds = time.perf_counter() - t0
                tokens = sum(len(c.token_ids) for c in out)
                speeds[follow].append(tokens / seconds)
                taus[follow].append(tokens / sum(c.steps for c in out))
                answers.setdefault(follow, [c.token_ids for c in out])
        on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
        print(f"{label}: drafts follow the rules {on:.1f} tok/s (tau {statistics.median(taus[True]):.2f}), "
              f"ignore them {off:.1f} tok/s (tau {statistics.median(taus[False]):.2f}): {on / off:.2f}x; "
              f"identical {answers[True] == answers[False]}")
    drafter.follow_rules = True


if __name__ == "__main__":
    main()
