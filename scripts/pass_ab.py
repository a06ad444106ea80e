"""A whole verify pass with a kernel switch off and on, alternating in one process: the default
model, a binary tree of R rows after L context tokens (random ids), fastest of N passes each.
Prints the time of each, the median ratio over the rounds, and whether the rows' logits agree
bit for bit (a switch that changes the arithmetic gives other bits; the tests check each path
on its own).

    python scripts/pass_ab.py --switch SOT_NO_BF16_ATTENTION --dtype bfloat16

The switch must be one the kernels read at each call (``sot.kernels.SWITCHES``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from sot.attention import build_tree_layout
    from sot.kernels import SWITCHES
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.tree import ancestor_table, tree_from_parents

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", default="SOT_NO_BF16_ATTENTION", choices=SWITCHES)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--contexts", default="256,900,1500")
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    os.environ.pop(args.switch, None)
    loaded = load_model("default", dtype=getattr(torch, args.dtype))
    target = TargetModel(loaded.model)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    contexts = [int(c) for c in args.contexts.split(",")]
    cache = target.new_cache(1, max(contexts) + 128)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (max(contexts),), generator=gen)
    target.prefill(cache, 0, prompt)

    def timed(switch_on: bool, fn) -> tuple[float, torch.Tensor]:
        if switch_on:
            os.environ[args.switch] = "1"
        try:
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out
        finally:
            os.environ.pop(args.switch, None)

    print(f"| context | rows | {args.switch}=1 ms | unset ms | speed-up | same bits |")
    print("|---|---|---|---|---|---|")
    for length in contexts:
        cache.set_length(0, length)
        for rows in (int(r) for r in args.rows.split(",")):
            tree = tree_from_parents(prompt[length - rows:length].tolist(),
                                     [-1] + [(i - 1) // 2 for i in range(1, rows)])
            padded = rows + (-rows % target.row_multiple)
            ids = torch.full((1, padded), int(tree.tokens[0]))
            ids[0, :rows] = torch.tensor(tree.tokens)
            pos = torch.full((1, padded), length)
            pos[0, :rows] = torch.tensor(tree.depths) + length
            layout = build_tree_layout(cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], padded, cache)

            def run():
                return target.verify(cache, ids, pos, layout).logits[0, :rows].clone()

            off_t, on_t = [], []
            off, on = None, None
            for r in range(args.repeats + 1):
                order = (True, False) if r % 2 == 0 else (False, True)
                for switch_on in order:
                    dt, out = timed(switch_on, run)
                    if r == 0:  # (a warm-up pass each)
                        off, on = (out, on) if switch_on else (off, out)
                        continue
                    (off_t if switch_on else on_t).append(dt)
            ratio = statistics.median(a / b for a, b in zip(off_t, on_t))
            print(f"| {length} | {rows} | {min(off_t) * 1e3:.2f} | {min(on_t) * 1e3:.2f} | {ratio:.2f}x | "
                  f"{'yes' if torch.equal(off, on) else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
