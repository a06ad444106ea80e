"""One-row verify passes of the default model (float32) on 2 threads and on 1, with the
machine to itself and with a busy process on one core, alternating in one process: medians of
PASSES passes per condition and round, at CONTEXT tokens of context.

    python scripts/threads_ab.py --rounds 3

What ``--threads`` is for: on a machine other work shares, a pass waits for its slowest thread.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from sot.attention import build_tree_layout
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.tree import ancestor_table, tree_from_parents

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    loaded = load_model("default", dtype=torch.float32)
    target = TargetModel(loaded.model)
    cache = target.new_cache(1, args.context + 64)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.model.config.vocab_size, (args.context,), generator=gen)
    target.prefill(cache, 0, prompt)
    tree = tree_from_parents(prompt[-1:].tolist(), [-1])
    ids, pos = torch.tensor([[int(tree.tokens[0])]]), torch.tensor([[args.context]])
    layout = build_tree_layout(cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], 1, cache)

    def median_ms() -> float:
        times = []
        for _ in range(args.passes):
            t0 = time.perf_counter()
            target.verify(cache, ids, pos, layout).logits[0, :1].sum()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    results: dict[tuple[bool, int], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            time.sleep(0.3)
            try:
                for threads in (2, 1):
                    torch.set_num_threads(threads)
                    results.setdefault((busy, threads), []).append(median_ms())
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print("| other work | threads | median one-row pass, ms | rounds |")
    print("|---|---|---|---|")
    for (busy, threads), values in results.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {'a busy process' if busy else 'none'} | {threads} | {statistics.median(values):.2f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
