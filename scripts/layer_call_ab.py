"""The decoder layers in one compiled call against the Python loop over the same kernels.

Both run in one process on the default model (float32), on the same verify passes as the
engine packs them, alternating pass by pass; every pair's logits are checked to be the same
bits. Prints, per context length and row count, the best time of each and the median of the
pairwise speed-ups.

    python scripts/layer_call_ab.py [--contexts 256 900] [--rows 1 4 16] [--rounds 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.tree import tree_from_parents
    from sot.packing import pack_trees

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 900])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()

    loaded = load_model("default", dtype=torch.float32)
    target = TargetModel(loaded.model)
    compiled = target.fast.layer_call
    if compiled is None:
        raise SystemExit("the compiled layer loop is not available here (no compiled kernels, or products outside them)")
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    print(f"{'keys':>5} {'rows':>4} {'python ms':>10} {'compiled ms':>12} {'speed-up':>9}")
    for context in args.contexts:
        cache = target.new_cache(1, context + 64)
        prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0))
        target.prefill(cache, 0, prompt)
        cache.set_length(0, context)
        for rows in args.rows:
            tree = tree_from_parents(prompt[-rows:].tolist(), [-1] + [(i - 1) // 2 for i in range(1, rows)])
            batch = pack_trees([tree], cache, target)
            times: dict[bool, list[float]] = {True: [], False: []}
            logits = {}
            for i in range(args.rounds):
                for use in ((True, False) if i % 2 == 0 else (False, True)):
                    target.fast.layer_call = compiled if use else None
                    t0 = time.perf_counter()
                    out = target.verify(cache, batch.ids, batch.positions, batch.layout)
                    times[use].append(time.perf_counter() - t0)
                    logits[use] = out.logits
                if not torch.equal(logits[True], logits[False]):
                    raise SystemExit(f"logits differ at {context} keys, {rows} rows")
            ratios = [p / c for p, c in zip(times[False], times[True])]
            print(f"{context:>5} {rows:>4} {min(times[False]) * 1e3:>10.2f} {min(times[True]) * 1e3:>12.2f} "
                  f"{statistics.median(ratios):>8.3f}x")
    target.fast.layer_call = compiled


if __name__ == "__main__":
    main()
