"""What a prompt budget does to running streams: one request decodes, a long prompt arrives,
and the running request's longest wait between two tokens is timed, with the budget and
without it, alternating rounds in one process on the default model.

    python scripts/prompt_budget_ab.py [--prompt 1500] [--budget 256] [--rounds 3]

Prints, per setting, the median over rounds of the running request's longest gap between
tokens after the arrival, the long request's time to its first token, and whether every
output matched across settings.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def one_round(engine, short: list[int], long_: list[int], params_short, params_long) -> dict:
    """The short request decodes 8 steps, then the long one joins; both run to the end."""
    short_id = engine.add_request(short, params_short)
    stamps: list[float] = []
    tokens: dict[int, list[int]] = {}
    long_id, arrived, first = None, 0.0, None
    steps = 0
    while engine.has_unfinished():
        if steps == 8:
            long_id, arrived = engine.add_request(long_, params_long), time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        steps += 1
        for ev in events:
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.request_id == short_id and ev.token_ids and long_id is not None:
                stamps.append(now)
            if ev.request_id == long_id and first is None and ev.token_ids:
                first = now - arrived
    gaps = [b - a for a, b in zip([arrived] + stamps, stamps)]
    return {"gap": max(gaps) if gaps else 0.0, "ttft": first or 0.0,
            "tokens": (tokens[short_id], tokens[long_id])}


def main() -> None:
    from sot.api import SoT

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1500, help="tokens of the arriving prompt")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sot = SoT.load(prefix_cache_mb=0)  # every round reads the long prompt again
    engine = sot.engine
    vocab = engine.target.vocab_size
    gen = torch.Generator().manual_seed(0)
    short = sot.encode("Write a short story about a lighthouse keeper.")
    params_short = sot.params(max_new_tokens=160, ignore_eos=True)
    params_long = sot.params(max_new_tokens=16)
    one_round(engine, short, torch.randint(0, vocab, (64,), generator=gen).tolist(), params_short,
              params_long)  # warm-up
    got: dict[str, list[dict]] = {"whole prompts": [], f"budget {args.budget}": []}
    for r in range(args.rounds):
        long_ = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
        order = list(got) if r % 2 == 0 else list(reversed(got))
        for name in order:
            engine.prompt_budget = None if name == "whole prompts" else args.budget
            got[name].append(one_round(engine, short, long_, params_short, params_long))
    same = all(a["tokens"] == b["tokens"] for a, b in zip(*got.values()))
    print(f"{args.prompt}-token prompt arriving while one request decodes; {args.rounds} rounds; "
          f"outputs identical across settings: {same}")
    print("| setting | longest wait between the running request's tokens, s | arriving request's first token, s |")
    print("|---|---|---|")
    for name, runs in got.items():
        print(f"| {name} | {statistics.median(x['gap'] for x in runs):.3f} | "
              f"{statistics.median(x['ttft'] for x in runs):.3f} |")


if __name__ == "__main__":
    main()
