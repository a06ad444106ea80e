"""Time the float32 linear kernels on the default model's products, as the engine runs them.

One "pass" is every linear layer of SmolLM2-135M once (30 x (q/k/v, o, gate/up, down) plus
the LM head, about 538 MB of float32 weights, more than any CPU cache), for a block of M
rows, as in plain decoding (M = 1) and in verifying an M-node tree. The weights are random
but, like the default model's (dequantized from its GGUF file), exact Q4_1 blocks (layers)
and Q8_0 blocks (head), so SoT's block kernel applies. The kernels take turns, round after
round, and each keeps its fastest pass.

    .venv/bin/python scripts/linear_bench.py [--rows 1,4,8,16,32] [--rounds 6]
"""
from __future__ import annotations

import argparse
import time

import torch

from sot.kernels import cpu_kernels
from sot.kernels.linear import pack_blocks, pack_panels
from sot.models.rows import ROW_UNIT

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def gguf_like(n: int, k: int, gen: torch.Generator, bits: int) -> torch.Tensor:
    """A random ``[n, k]`` float32 weight that is exactly Q4_1 (``bits=4``) or Q8_0 blocks."""
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.004).half().float()
    if bits == 8:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
        q[..., 0] = 127  # the quantizer maps a block's largest magnitude to 127
        return (scale * q).reshape(n, k)
    low = (-torch.rand(n, k // 32, 1, generator=gen) * 0.03).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # and a Q4_1 block's minimum to 0, its maximum to 15
    return (scale * q + low).reshape(n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    weights = [gguf_like(n, k, gen, bits=8 if n == SHAPES[-1][0] else 4) for n, k in SHAPES]
    x = {m: {k: torch.randn(m, k, generator=gen) for k in (576, 1536)} for m in rows}
    kernels = {}
    sot = cpu_kernels()
    if sot is not None:
        panels = [pack_panels(w) for w in weights]
        kernels["sot linear_f32"] = lambda m: [sot.linear_f32(x[m][w.shape[1]], p, w.shape[0], None)
                                               for w, p in zip(weights, panels)]
        blocks = [pack_blocks(w) for w in weights]
        assert all(b is not None for b in blocks)
        kernels["sot 4/8-bit blocks"] = lambda m: [sot.linear_blocks_f32(x[m][w.shape[1]], *b, w.shape[0], None, True)
                                                   for w, b in zip(weights, blocks)]
        kernels["sot blocks, L1 blocks only"] = lambda m: [sot.linear_blocks_f32(x[m][w.shape[1]], *b, w.shape[0], None,
                                                                             False) for w, b in zip(weights, blocks)]
    if torch.backends.mkldnn.is_available():
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, ROW_UNIT) for w in weights]
        kernels["oneDNN packed"] = lambda m: [torch.ops.mkldnn._linear_pointwise(x[m][w.shape[1]], p, None, "none", [], "")
                                              for w, p in zip(weights, dnn)]
    if torch.backends.mkl.is_available():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, ROW_UNIT) for w in weights]
        kernels["MKL packed"] = lambda m: [torch.ops.mkl._mkl_linear(x[m][w.shape[1]], p, w, None, ROW_UNIT)
                                           for w, p in zip(weights, mkl)]
    best = {(name, m): float("inf") for name in kernels for m in rows}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for m in rows:
            for name, run in kernels.items():
                t0 = time.perf_counter()
                run(m)
                if round_:
                    best[name, m] = min(best[name, m], time.perf_counter() - t0)
    print(f"ms per pass over all linear layers ({torch.get_num_threads()} threads)")
    print("| kernel | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in kernels:
        print(f"| {name} | " + " | ".join(f"{best[name, m] * 1000:.1f}" for m in rows) + " |")


if __name__ == "__main__":
    main()
