"""``--dtype int8`` against ``float32`` on the default model, side by side in one process.

1. Verify passes of 1-32 rows after a 256-token context, the two modes alternating pass by
   pass (best time of each and the median of the pairwise ratios).
2. Agreement with float32: the two modes read the same ShareGPT prompts (teacher forcing) and
   the script counts where their greedy choices agree, with the mean KL divergence.
3. Decoding: ``plain`` and ``state`` in each mode, prompt by prompt in turn, on ShareGPT
   held-out and HumanEval prompts (greedy); tokens/s, tau, and whether each mode's ``state``
   answers equal its ``plain`` ones.

    python scripts/int8_ab.py [--prompts 8] [--max-new-tokens 256] [--rows 1 4 8 16 32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("float32", "int8")


def verify_passes(sots: dict, rows_list: list[int], rounds: int, context: int = 256) -> None:
    from sot.packing import pack_trees
    from sot.tree import tree_from_parents

    print(f"\nverify passes after {context} keys (best ms; median ratio float32 / int8 over {rounds} rounds)")
    setups = {}
    for mode, sot in sots.items():
        target = sot.engine.target
        cache = target.new_cache(1, context + 64)
        vocab = target.vocab_size
        prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0))
        target.prefill(cache, 0, prompt)
        cache.set_length(0, context)
        setups[mode] = (target, cache, prompt)
    for rows in rows_list:
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(rounds):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                target, cache, prompt = setups[mode]
                tree = tree_from_parents(prompt[-rows:].tolist(), [-1] + [(j - 1) // 2 for j in range(1, rows)])
                batch = pack_trees([tree], cache, target)
                t0 = time.perf_counter()
                target.verify(cache, batch.ids, batch.positions, batch.layout).logits  # (every row's logits)
                times[mode].append(time.perf_counter() - t0)
        ratio = statistics.median(f / q for f, q in zip(times["float32"], times["int8"]))
        best = {m: min(times[m]) * 1e3 for m in MODES}
        print(f"  {rows:>2} rows: float32 {best['float32']:6.2f} ms, int8 {best['int8']:6.2f} ms, {ratio:.2f}x")


def agreement(sots: dict, texts: list[str]) -> None:
    top1 = total = 0
    kl = 0.0
    for text in texts:
        ids = torch.tensor(sots["float32"].tokenizer(text)["input_ids"][:512])
        logits = {}
        for mode, sot in sots.items():
            target = sot.engine.target
            cache = target.new_cache(1, len(ids) + 64)
            rows: list[torch.Tensor] = []
            target.prefill(cache, 0, ids, on_rows=lambda lg, _off: rows.append(lg.reshape(-1, lg.shape[-1]).float()))
            logits[mode] = torch.cat(rows)
        top1 += int((logits["float32"].argmax(-1) == logits["int8"].argmax(-1)).sum())
        total += len(ids)
        p = torch.log_softmax(logits["float32"], -1)
        q = torch.log_softmax(logits["int8"], -1)
        kl += float((p.exp() * (p - q)).sum())
    print(f"\nagreement with float32, reading {total} tokens of {len(texts)} ShareGPT prompts: greedy choice "
          f"{top1 / total:.2%}, mean KL(float32 || int8) {kl / total:.5f} nats")


def _text(record: dict) -> str:
    """A prompt record's first user message."""
    if record.get("turns"):
        return record["turns"][0]
    if record.get("messages"):
        return next(m["content"] for m in record["messages"] if m["role"] == "user")
    return record["prompt"]


def decode(sots: dict, set_name: str, n: int, max_new: int) -> None:
    from sot.bench.prompts import load_prompt_set

    records = load_prompt_set(set_name, limit=n)
    print(f"\n{set_name}: {n} prompts, {max_new} tokens, greedy")
    stats = {(m, d): {"tokens": 0, "seconds": 0.0, "steps": 0, "answers": []} for m in MODES for d in ("none", "state")}
    for record in records:
        for mode in MODES:
            prompt = sots[(mode, "none")].encode(_text(record))
            for drafter in ("none", "state"):
                sot = sots[(mode, drafter)]
                t0 = time.perf_counter()
                out = sot.generate_ids([prompt], sot.params(max_new_tokens=max_new))[0]
                s = stats[(mode, drafter)]
                s["seconds"] += time.perf_counter() - t0
                s["tokens"] += len(out.token_ids)
                s["steps"] += out.steps
                s["answers"].append(out.token_ids)
    speed = {k: v["tokens"] / v["seconds"] for k, v in stats.items()}
    for mode in MODES:
        plain, state = stats[(mode, "none")], stats[(mode, "state")]
        print(f"  {mode:>7}: plain {speed[(mode, 'none')]:6.1f} tok/s, state {speed[(mode, 'state')]:6.1f} tok/s "
              f"(tau {state['tokens'] / state['steps']:.2f}, {speed[(mode, 'state')] / speed[(mode, 'none')]:.2f}x "
              f"plain), state identical to plain {plain['answers'] == state['answers']}")
    same = sum(a == b for a, b in zip(stats[("int8", "none")]["answers"], stats[("float32", "none")]["answers"]))
    print(f"  int8 / float32: plain {speed[('int8', 'none')] / speed[('float32', 'none')]:.2f}x, "
          f"state {speed[('int8', 'state')] / speed[('float32', 'state')]:.2f}x; "
          f"answers equal to float32's: {same}/{n}")


def main() -> None:
    from sot import SoT
    from sot.bench.prompts import load_prompt_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    sots = {(mode, drafter): SoT.load("default", dtype=mode, drafter=drafter, prefix_cache_mb=0)
            for mode in MODES for drafter in ("none", "state")}
    for sot in sots.values():  # untimed: the first call times the verify-cost curve (once per machine)
        sot.generate_ids([sot.encode("Hello")], sot.params(max_new_tokens=16))
    plain = {mode: sots[(mode, "none")] for mode in MODES}
    verify_passes(plain, args.rows, args.rounds)
    texts = [_text(r) for r in load_prompt_set("sharegpt-heldout", limit=args.prompts)]
    agreement(plain, texts)
    for name in ("sharegpt-heldout", "humaneval"):
        decode(sots, name, args.prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
