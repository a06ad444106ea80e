"""Drafting for sampled answers, side by side: the state drafter drafting by its own
distribution (its likeliest tokens) and drafting by each request's coupled draw (the noise
that fixes the sampled token at each position, ``StateDrafter._child_logp``), in one process,
taking turns prompt by prompt (the order rotating), so a busy moment on the machine slows
each alike. Coupled sampling gives the same sample whatever was drafted, so every answer
should equal plain decoding's.

Speed (default): plain decoding and the two ways of drafting under the default commit policy.
Prints tokens/s, the ratio to plain decoding, tau and the answers equal to plain decoding's.

    python scripts/sampling_ab.py --set sharegpt-heldout --limit 8 --tokens 128 --temperature 1.0

``--no-fallback`` keeps the policy drafting on every step (its cost model still prunes the
trees), for a machine where it would otherwise keep the predictor idle.

Acceptance (``--chains D``): every step verifies a chain of ``D`` predictor tokens whole (the
static policy, one child per depth, no free drafts), so each way of drafting is judged on
every position. Prints tau, how often the first drafted token was accepted, its mean draft
confidence (a calibrated confidence matches the rate), and the first token's acceptance by
confidence bin.

    python scripts/sampling_ab.py --chains 4 --limit 8 --tokens 128 --temperature 1.0
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sot.api import SoT  # noqa: E402
from sot.bench.prompts import load_prompt_set  # noqa: E402
from sot.policy import PolicyConfig  # noqa: E402


def first_tokens(outs: list) -> list[tuple[float, bool]]:
    """(draft confidence, accepted) of the first drafted token of every drafting step."""
    got = []
    for out in outs:
        for rec in out.step_records:
            if rec.mode == "draft" and len(rec.tokens) > 1 and rec.verified[1]:
                got.append((rec.confidences[1], len(rec.accepted) > 1 and rec.accepted[1] == 1))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="sharegpt-heldout", help="a built-in prompt set or a JSONL file")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--drafter", default="state", help="state or auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (seeds differ per round)")
    ap.add_argument("--chains", type=int, default=0, help="verify chains of this many predictor tokens whole")
    ap.add_argument("--no-fallback", action="store_true",
                    help="the default policy without its fallback to plain decoding (it drafts every step)")
    args = ap.parse_args()
    chains = args.chains > 0
    if chains:
        drafted = SoT.load(drafter="state", dtype=args.dtype, policy="static", top_k=1, max_depth=args.chains,
                           predictor_depth=args.chains, max_nodes=args.chains + 1, predictor_nodes=args.chains + 1)
        drafted.engine.drafter.min_confidence = 0.0  # (a chain's every token, however unlikely)
        arms = ["own distribution", "coupled draw"]
    else:
        plain = SoT.load(drafter="none", dtype=args.dtype)
        policy = PolicyConfig(fallback_threshold=0.0) if args.no_fallback else None
        drafted = SoT.load(drafter=args.drafter, dtype=args.dtype, policy=policy)
        arms = ["plain", "own distribution", "coupled draw"]
    prompts = load_prompt_set(args.set, limit=args.limit)
    got: dict[str, list] = {a: [] for a in arms}
    passes = dict.fromkeys(arms, 0)  # predictor passes
    n = 0
    for r in range(args.rounds):
        for i, record in enumerate(prompts):
            order = arms[n % len(arms):] + arms[:n % len(arms)]
            n += 1
            for arm in order:
                sot = plain if arm == "plain" else drafted
                sot.engine.drafter.follow_draws = arm == "coupled draw"
                params = sot.params(max_new_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p,
                                    seed=args.seed + r * len(prompts) + i)
                before = getattr(sot.engine.drafter, "passes", 0)
                got[arm].append(sot.generate_ids([sot.encode(record)], params, trace=chains)[0])
                passes[arm] += getattr(sot.engine.drafter, "passes", 0) - before
            print(f"round {r + 1}, prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    base = got[arms[0]]
    print(f"{args.set}, temperature {args.temperature}, top-p {args.top_p}, {args.tokens} tokens, "
          + (f"chains of {args.chains} verified whole" if chains else
             f"drafter {args.drafter}, default policy{' without fallback' if args.no_fallback else ''}"))
    if chains:
        print(f"| drafts by | tau | first token accepted | its mean confidence | answers equal to {arms[0]}'s |")
        print("|---|---|---|---|---|")
        for a, outs in got.items():
            first = first_tokens(outs)
            same = sum(x.token_ids == y.token_ids for x, y in zip(outs, base))
            print(f"| {a} | {statistics.mean(o.mean_accept_len for o in outs):.2f} | "
                  f"{sum(h for _, h in first) / len(first):.3f} ({len(first)} steps) | "
                  f"{statistics.mean(c for c, _ in first):.3f} | {same}/{len(outs)} |")
        for a, outs in got.items():
            bins: dict[int, list[bool]] = {}
            for c, hit in first_tokens(outs):
                bins.setdefault(min(4, int(c * 5)), []).append(hit)
            print(f"{a}, first token accepted by confidence: " + ", ".join(
                f"{b / 5:.1f}-{(b + 1) / 5:.1f}: {sum(v) / len(v):.2f} ({len(v)})" for b, v in sorted(bins.items())))
        return 0
    rate = {a: sum(o.new_tokens for o in outs) / sum(o.seconds for o in outs) for a, outs in got.items()}
    print("| arm | tok/s | vs plain | median per prompt | tau | predictor passes | answers equal to plain's |")
    print("|---|---|---|---|---|---|---|")
    for a, outs in got.items():
        same = sum(x.token_ids == y.token_ids for x, y in zip(outs, base))
        per = statistics.median(x.tokens_per_s / y.tokens_per_s for x, y in zip(outs, base))
        print(f"| {a} | {rate[a]:.1f} | {rate[a] / rate['plain']:.3f}x | {per:.3f}x | "
              f"{statistics.mean(o.mean_accept_len for o in outs):.2f} | {passes[a]} | {same}/{len(outs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
