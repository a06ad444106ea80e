"""Drafting settings side by side in one process: tree budgets and lookup n-gram sizes.

Each variant is its own engine (its own suffix store and prefix cache) over one shared
model file, all in one mode (``--dtype``, bfloat16 by default), greedy. With ``--batch 1``
every record is run as a conversation turn by turn (multi-turn sets) or as one prompt, the
variants taking turns in an order that alternates per record; with ``--batch B`` the prompts
of each round form one ``generate_ids`` call at batch ``B`` and the variants take turns per
round. Prints tokens/s, tau, rows verified and time per step (per sequence-step in a batch),
and the ratio to the first variant per turn (or per batch), and how many answers equal the
first variant's.

A variant is ``plain`` or ``DRAFTER:MAX_NODES:MAX_DEPTH[:NGRAM]`` (``NGRAM``: the longest
n-gram prompt lookup tries), optionally followed by ``+eager`` (every row's logits computed
with the verify pass, as before the LM head computed only the rows acceptance reads) or
``+stale`` (the batch guard's back-offs run their length whoever joins, as before a new
request ended them) or ``+loops`` (attention over the bfloat16 cache by the float32 loops, not
the AVX512-BF16 pair dot products: ``SOT_NO_BF16_ATTENTION`` set while the variant loads and
runs) or ``+blocks`` (wide products decode the 4/8-bit blocks as narrow ones do, without the
decoded copy: ``SOT_NO_BF16_PAIRS``) or ``+held`` (the drafter's engine with every step held plain by the fixed rule,
``disable_above`` 1: its machinery without its drafts) or ``+open`` (an offline call's batch
planned as an open one, by tokens per second, as before closed batches were planned for their
end), and by ``@label`` to run a setting twice.

    python scripts/budget_ab.py --set code-edit-multiturn --variants plain,auto:16:8,auto:32:24
    python scripts/budget_ab.py --set sharegpt-heldout --n 64 --batch 16 --rounds 4 \\
        --variants plain,state:32:24:3,state:32:24:8
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace


@contextmanager
def kernel_env(variant: str):
    """The kernels' switches a variant loads and runs under (``+loops``:
    SOT_NO_BF16_ATTENTION; ``+blocks``: SOT_NO_BF16_PAIRS)."""
    spec = variant.split("@")[0]
    switches = [name for flag, name in (("+loops", "SOT_NO_BF16_ATTENTION"), ("+blocks", "SOT_NO_BF16_PAIRS"))
                if flag in spec]
    for name in switches:
        os.environ[name] = "1"
    try:
        yield
    finally:
        for name in switches:
            os.environ.pop(name, None)


def make(variant: str, dtype: str = "bfloat16"):
    from sot import SoT

    spec = variant.split("@")[0].replace("+loops", "").replace("+blocks", "")
    spec, eager = spec.removesuffix("+eager"), spec.endswith("+eager")
    spec, stale = spec.removesuffix("+stale"), spec.endswith("+stale")
    spec, held = spec.removesuffix("+held"), spec.endswith("+held")
    spec, open_ = spec.removesuffix("+open"), spec.endswith("+open")
    if spec == "plain":
        sot = SoT.load("default", drafter="none", dtype=dtype)
    else:
        drafter, nodes, depth, *ngram = spec.split(":")
        sot = SoT.load("default", drafter=drafter, dtype=dtype, max_nodes=int(nodes), max_depth=int(depth))
        if ngram:
            sot.engine.drafter.free.lookup.max_ngram = int(ngram[0])
    if eager:  # every row's logits computed with the pass
        sot.engine.target.lazy_head = False
    if held:  # the fixed rule holds every step of two or more sequences plain
        policy = sot.engine.policy
        policy.config = replace(policy.config, disable_above=1)
    if open_:  # the policy is never told that the batch is closed
        plan = sot.engine.policy.plan
        sot.engine.policy.plan = lambda generated, free, budget, left=None: plan(generated, free, budget)
    if stale:  # joins do not end the guard's back-offs
        sot.engine.policy.guard.joined = lambda: None
    return sot


def conversations(sots: dict, records: list[dict], max_new: int) -> dict:
    from sot.bench.conversations import turn_messages

    variants = list(sots)
    stat = defaultdict(lambda: [0, 0.0, 0, [], 0])  # (variant, turn) -> tokens, seconds, steps, answers, rows
    for i, record in enumerate(records):
        turns = record.get("turns") or [None]
        order = variants if i % 2 == 0 else variants[::-1]
        answers = {v: [] for v in variants}
        for t, user in enumerate(turns):
            for v in order:
                sot = sots[v]
                item = {"messages": turn_messages(record, answers[v])} if user is not None else record["prompt"]
                ids = sot.encode(item)
                with kernel_env(v):
                    t0 = time.perf_counter()
                    out = sot.generate_ids([ids], sot.params(max_new_tokens=max_new))[0]
                st = stat[(v, t)]
                st[0] += len(out.token_ids)
                st[1] += time.perf_counter() - t0
                st[2] += out.steps
                st[3].append(out.token_ids)
                st[4] += sum(out.tree_sizes)
                answers[v].append(sot.tokenizer.decode(out.token_ids, skip_special_tokens=True))
        print(f"record {i + 1}/{len(records)}", file=sys.stderr, flush=True)
    return stat


def batches(sots: dict, records: list[dict], max_new: int, batch: int, rounds: int) -> dict:
    variants = list(sots)
    first = sots[variants[0]]
    prompts = [first.encode(r["turns"][0] if r.get("turns") else r["prompt"]) for r in records]
    stat = defaultdict(lambda: [0, 0.0, 0, [], 0])
    for r in range(rounds):
        part = prompts[r * len(prompts) // rounds:(r + 1) * len(prompts) // rounds]
        for v in (variants if r % 2 == 0 else variants[::-1]):
            sot = sots[v]
            with kernel_env(v):
                t0 = time.perf_counter()
                outs = sot.generate_ids(part, sot.params(max_new_tokens=max_new), batch_size=batch)
                st = stat[(v, 0)]
                st[1] += time.perf_counter() - t0
            for out in outs:
                st[0] += len(out.token_ids)
                st[2] += out.steps
                st[3].append(out.token_ids)
                st[4] += sum(out.tree_sizes)
    return stat


def main() -> None:
    from sot.bench.conversations import MULTITURN_SETS, load_conversations
    from sot.bench.prompts import load_prompt_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="code-edit-multiturn")
    ap.add_argument("--n", type=int, default=8, help="records (conversations or prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="with --batch > 1: calls per variant, each its own prompts")
    ap.add_argument("--variants", default="plain,auto:16:8,auto:32:24")
    ap.add_argument("--dtype", default="bfloat16", help="the mode every variant loads in (auto: --dtype auto's choice)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if len(set(variants)) != len(variants):
        ap.error("a variant named twice: add @label to tell the copies apart")
    sots = {}
    for v in variants:
        with kernel_env(v):
            sots[v] = make(v, args.dtype)
            sot = sots[v]  # untimed: kernels, the cost curve
            sot.generate_ids([sot.encode("Hello")] * 2, sot.params(max_new_tokens=16), batch_size=2)
    if args.set in MULTITURN_SETS:
        records = load_conversations(args.set, args.n)
    else:
        records = load_prompt_set(args.set, limit=args.n)
    if args.batch > 1:
        stat = batches(sots, records, args.max_new_tokens, args.batch, args.rounds)
    else:
        stat = conversations(sots, records, args.max_new_tokens)
    turns = sorted({t for _, t in stat})
    for t in turns:
        base = stat[(variants[0], t)]
        cells = []
        for v in variants:
            tokens, seconds, steps, _, rows = stat[(v, t)]
            ratio = (tokens / seconds) / (base[0] / base[1])
            per_step = max(steps, 1)
            cells.append(f"{v} {tokens / seconds:6.1f} tok/s (tau {tokens / per_step:.2f}, {rows / per_step:.1f} rows, "
                         f"{1000 * seconds / per_step:.1f} ms a step, x{ratio:.3f})")
        where = f"batch {args.batch}" if args.batch > 1 else f"turn {t + 1}"
        print(f"{args.set} {where}: " + "  ".join(cells))
    same = {v: sum(a == b for t in turns for a, b in zip(stat[(v, t)][3], stat[(variants[0], t)][3]))
            for v in variants}
    total = sum(len(stat[(variants[0], t)][3]) for t in turns)
    print("answers equal to the first variant's: " + ", ".join(f"{v} {n}/{total}" for v, n in same.items()))


if __name__ == "__main__":
    main()
