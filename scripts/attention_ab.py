"""The exact tree-attention kernel of this checkout against the one of another git revision,
built side by side in one process: the same inputs (30 layers of random K/V, SmolLM2-135M's
9 query and 3 KV heads, head dim 64), a chain of R rows after L committed keys, alternating,
best of N. Prints the time of each and whether every output has the same bits (a kernel that
changes its arithmetic gives other bits; the tests check that each is exact by itself). Each
kernel gets the keys in its own layout: tiles of 16 slots ``[B, Hkv, S / 16, D, 16]``, or, for
revisions before them, rows of slots per dimension ``[B, Hkv, D, S']``.

    python scripts/attention_ab.py --base be56857 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sot.kernels import cpu_kernels  # noqa: E402

BINDING = ('#include "common.h"\n#include <torch/csrc/utils/pybind.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) '
           '{ m.def("tree_attention_exact", &tree_attention_exact, "base"); }\n')


def build_base(rev: str, where: Path):
    """The attention kernel of ``rev``, built as its own module."""
    from torch.utils.cpp_extension import load

    for name in ("attention.cpp", "common.h"):
        text = subprocess.run(["git", "show", f"{rev}:sot/kernels/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (where / name).write_text(text)
    (where / "module.cpp").write_text(BINDING)
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"] \
        if capability.startswith(("AVX512", "AMX")) else (["-mavx2", "-mfma", "-mf16c"] if capability == "AVX2" else [])
    return load(name="sot_attention_base", sources=[str(where / "attention.cpp"), str(where / "module.cpp")],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)


def row_stride(capacity: int) -> int:
    """The padded slot stride of the rows layout (an odd number of 64-byte lines per row)."""
    return capacity + 16 if (capacity // 16) % 2 == 0 else capacity


def as_tiles(rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """Keys ``[B, Hkv, D, S']`` (rows of slots) as tiles ``[B, Hkv, capacity / 16, D, 16]``."""
    batch, heads, dim, _ = rows.shape
    return rows[..., :capacity].reshape(batch, heads, dim, -1, 16).permute(0, 1, 3, 2, 4).contiguous()


def takes_tiles(mod) -> bool:
    """Whether a built kernel reads tiled keys (a 5-dimensional key tensor)."""
    q, values = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 16, 16)
    args = (torch.tensor([0]), torch.zeros(1, 1, 1, dtype=torch.long), torch.tensor([1]), 1.0, 0, 0.0)
    try:
        mod.tree_attention_exact(q, torch.zeros(1, 1, 1, 16, 16), values, *args)
        return True
    except RuntimeError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose kernel is compared")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the cache's and q's dtype (bfloat16: a bfloat16 model's cache)")
    ap.add_argument("--rows", default="1,9,16", help="rows of the chain, comma-separated")
    args = ap.parse_args()
    new = cpu_kernels()
    if new is None:
        print("the compiled kernels cannot be built here", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, Path(tmp))
        heads, kv_heads, dim, layers = 9, 3, 64, 30
        dtype = getattr(torch, args.dtype)
        gen = torch.Generator().manual_seed(0)
        print(f"| keys | capacity | rows | {args.base} ms | this checkout ms | speed-up | same bits |")
        print("|---|---|---|---|---|---|---|")
        layouts = {id(mod): takes_tiles(mod) for mod in (base, new)}
        most = max(int(r) for r in args.rows.split(","))
        for length in (256, 900, 1500, 3000):
            capacity = (length + most + 127) // 128 * 128  # (room for the longest chain's rows)
            rows_keys = [torch.randn(1, kv_heads, dim, row_stride(capacity), generator=gen).to(dtype)
                         for _ in range(layers)]
            tiled_keys = [as_tiles(k, capacity) for k in rows_keys]
            values = [torch.randn(1, kv_heads, capacity, dim, generator=gen).to(dtype) for _ in range(layers)]
            for rows in (int(r) for r in args.rows.split(",")):
                q = torch.randn(1, heads, rows, dim, generator=gen).to(dtype)
                anc = torch.full((1, rows, rows), -1, dtype=torch.long)
                for r in range(rows):
                    anc[0, r, : r + 1] = torch.arange(length, length + r + 1)
                lengths, real = torch.tensor([length]), torch.tensor([rows])

                def run(mod):
                    ks = tiled_keys if layouts[id(mod)] else rows_keys
                    return [mod.tree_attention_exact(q, ks[i], values[i], lengths, anc, real, 0.125, 0, 0.0)
                            for i in range(layers)]

                same = all(torch.equal(a, b) for a, b in zip(run(base), run(new)))
                old_t, new_t = [], []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run(base)
                    old_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    run(new)
                    new_t.append(time.perf_counter() - t0)
                ratio = statistics.median(a / b for a, b in zip(old_t, new_t))
                print(f"| {length} | {capacity} | {rows} | {min(old_t) * 1e3:.2f} | {min(new_t) * 1e3:.2f} "
                      f"| {ratio:.2f}x | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
