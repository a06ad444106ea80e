"""The CPU tree attention kernel alone, with its caches read from memory as in a real pass.

In a decoding pass the weights stream through the cache between two layers' attention, so
each layer's keys and values come from memory, not from L3. This times
``tree_attention_exact`` over as many distinct layer caches as fill well past the last-level
cache, for batches of sequences with one row each (plain decoding), trees of a few rows
(verification) and long contexts, and prints each case's time for 30 layers (the default
model's count), the bytes of keys and values read a second and the multiply-adds a second:

    python scripts/attention_bench.py [--dtype float32|bfloat16] [--heads 9 --kv-heads 3 --head-dim 64]

Each case is the best of a few rounds; compare builds or machines side by side, never one
absolute figure.
"""
from __future__ import annotations

import argparse
import time

import torch

CASES = ((1, 1, 256), (8, 1, 256), (16, 1, 256), (1, 4, 256), (1, 16, 256), (8, 4, 256), (1, 1, 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the cache's dtype")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bytes", type=float, default=300e6, help="keys and values per round, past the L3")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from sot.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build here (see sot generate -v)")
    dtype = getattr(torch, args.dtype)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"{args.dtype} cache, {h} query heads over {hkv} KV heads of {d}, {torch.get_num_threads()} threads")
    print("| sequences | rows each | keys | 30 layers | KV read | GB/s | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for batch, rows, keys in CASES:
        slots = (keys + rows + 15) // 16 * 16
        per = 2 * batch * hkv * keys * d * torch.finfo(dtype).bits // 8  # keys and values read by one layer
        layers = max(30, int(args.bytes // per))
        caches = [(torch.randn(batch, hkv, slots // 16, d, 16).to(dtype), torch.randn(batch, hkv, slots, d).to(dtype))
                  for _ in range(layers)]
        q = torch.randn(batch, h, rows, d).to(torch.float32 if dtype == torch.float32 else dtype)
        lengths = torch.full((batch,), keys, dtype=torch.long)
        ancestors = torch.full((batch, rows, rows), -1, dtype=torch.long)
        for r in range(rows):  # a chain: row r sees the committed keys and rows 0 .. r
            ancestors[:, r, : r + 1] = torch.arange(keys, keys + r + 1)
        real = torch.full((batch,), rows, dtype=torch.long)
        best = float("inf")
        for _ in range(args.rounds + 1):
            t = time.perf_counter()
            for k, v in caches:
                kernels.tree_attention_exact(q, k, v, lengths, ancestors, real, d ** -0.5, 0, 0.0)
            best = min(best, time.perf_counter() - t)
        flops = 4 * batch * rows * h * keys * d * layers  # scores and weighted values, 2 flops a multiply-add
        print(f"| {batch} | {rows} | {keys} | {best / layers * 30 * 1e3:.2f} ms | {per * 30 / 1e6:.1f} MB | "
              f"{per * layers / best / 1e9:.1f} | {flops / best / 1e9:.0f} |")


if __name__ == "__main__":
    main()
