"""Roofline report of this machine: how close each exact path's passes come to the machine's peaks.

For each path the machine can run (float32 over GGUF 4-bit blocks, float32 panels, bfloat16, and
``--dtype int8``'s 8-bit integer products over the blocks), on the default model after a 256-token
context:
- the one-row pass (plain decoding's) and the 16-row verify pass, whole, fastest of rounds;
- the products alone (every packed weight of the pass, at 1 and 16 rows): achieved GB/s of weight
  bytes at one row, achieved GFLOP/s at 16 rows (for int8, integer multiply-adds counted as two
  operations, against the float32 peak);
- a breakdown of each pass by part: products, attention, norms, rope with the cache write, and the
  rest (embedding, activation, Python and dispatch), timed by wrapping each part's function; where
  the layers run as one compiled call, the breakdown is of the Python loop over the same kernels
  (the call's parts are out of the wrappers' reach), and both passes are timed whole.
The machine's peaks are measured the same way: a streaming read of 512 MiB (GB/s) and large matrix
products in float32 and bfloat16 (GFLOP/s).

    python scripts/roofline.py --out docs/roofline      # writes <machine>.json and <machine>.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

CONTEXT = 256
ROUNDS = 7


def best_of(fn, rounds: int = ROUNDS) -> float:
    """Fastest of ``rounds`` timed calls after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_bandwidth() -> float:
    """GB/s of a streaming read (a sum over 512 MiB of float32)."""
    x = torch.ones(128 << 20)
    return x.numel() * 4 / best_of(lambda: x.sum(), 5) / 1e9


def peak_flops(dtype: torch.dtype) -> float:
    """GFLOP/s of the fastest of a few large products in ``dtype`` (a square 1024 and 2048
    product, and 256 rows through a 2048 x 2048 linear layer, which oneDNN takes where aten's
    own square product is slow)."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (2048, 2048, 2048), (256, 2048, 2048)):
        a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        seconds = best_of(lambda: torch.nn.functional.linear(a, b), 3)
        best = max(best, 2 * m * k * n / seconds / 1e9)
    return best


class PartTimer:
    """Seconds spent in each wrapped part during the passes run inside :meth:`active`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.on = False

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0
            return out
        return timed

    @contextmanager
    def active(self):
        self.seconds, self.on = {}, True
        try:
            yield self
        finally:
            self.on = False


class _KernelProxy:
    def __init__(self, kernel, timer: PartTimer) -> None:
        self._kernel = kernel
        self.rope_write = timer.wrap("rope + cache write", kernel.rope_write)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def instrument(timer: PartTimer) -> None:
    """Wrap the parts of the Llama fast path (class and module level, so every layer is timed)."""
    import sot.models.fast_llama as fl
    from sot.kernels.linear import PackedLinear

    PackedLinear.__call__ = timer.wrap("products", PackedLinear.__call__)
    fl.tree_attention = timer.wrap("attention", fl.tree_attention)
    fl.FastLlama._add_rms = timer.wrap("norms", fl.FastLlama._add_rms)


def weight_bytes(lin) -> int:
    """Bytes a product streams per pass: the packed form it reads."""
    packed = lin.packed if lin.packed is not None else lin.weight
    parts = packed if isinstance(packed, tuple) else (packed,)
    return sum(p.numel() * p.element_size() for p in parts if isinstance(p, torch.Tensor))


def measure_path(name: str, dtype: torch.dtype, env: dict[str, str], timer: PartTimer, int8: bool = False) -> dict:
    from sot.attention import build_tree_layout
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model
    from sot.tree import ancestor_table, tree_from_parents

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        loaded = load_model("default", dtype=dtype, int8=int8)
        target = TargetModel(loaded.model)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    fast = target.fast
    fast.kernel = _KernelProxy(fast.kernel, timer) if fast.kernel is not None else None
    linears = [fast.lm_head] + [lin for lay in fast.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
    kinds = sorted({"int8" if lin.int8 else "bf16 blocks" if lin.bf16_blocks
                    else "blocks" if isinstance(lin.packed, tuple) else lin.kind for lin in linears})
    if "bf16 blocks" in kinds:
        # (read as bfloat16 weights decoded in registers; wide calls: decoded once ahead, or,
        # on AMX tiles, decoded at every row count)
        name += ", 4-bit blocks" if "blocks only" not in name else ""
        name += " on AMX tiles" if fast.kernel is not None and fast.kernel.amx_products() else ""
    nbytes = sum(weight_bytes(lin) for lin in linears)
    params = sum(lin.weight.numel() for lin in linears)

    cache = target.new_cache(1, CONTEXT + 64)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (CONTEXT,), generator=gen)
    target.prefill(cache, 0, prompt)
    cache.set_length(0, CONTEXT)
    out = {"path": name, "dtype": str(dtype).removeprefix("torch."), "int8": int8, "kernels": kinds,
           "weight_mb": round(nbytes / 1e6, 1), "params_m": round(params / 1e6, 1)}
    for rows in (1, 16):
        tree = tree_from_parents(prompt[-rows:].tolist(), [-1] + [(i - 1) // 2 for i in range(1, rows)])
        padded = rows if rows % target.row_multiple == 0 else rows + (-rows % target.row_multiple)
        ids = torch.full((1, padded), int(tree.tokens[0]))
        ids[0, :rows] = torch.tensor(tree.tokens)
        pos = torch.full((1, padded), CONTEXT)
        pos[0, :rows] = torch.tensor(tree.depths) + CONTEXT
        layout = build_tree_layout(cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], padded, cache)
        whole = best_of(lambda: target.verify(cache, ids, pos, layout).logits)  # (every row's logits, as before)
        call, fast.layer_call = fast.layer_call, None  # the loop: its parts can be timed
        loop = best_of(lambda: target.verify(cache, ids, pos, layout).logits) if call is not None else whole
        xs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1]).to(dtype) for lin in linears}
        products = best_of(lambda: [lin(xs[lin.weight.shape[1]], True) for lin in linears])
        parts: dict[str, float] = {}
        for _ in range(ROUNDS):  # the breakdown of the median pass under the wrappers
            with timer.active():
                t0 = time.perf_counter()
                target.verify(cache, ids, pos, layout).logits
                total = time.perf_counter() - t0
            for k, v in timer.seconds.items():
                parts.setdefault(k, []).append(v)
            parts.setdefault("_total", []).append(total)
        med = {k: sorted(v)[len(v) // 2] for k, v in parts.items()}
        med["rest"] = max(0.0, med["_total"] - sum(v for k, v in med.items() if k != "_total"))
        fast.layer_call = call
        out[f"rows{rows}"] = {
            "pass_ms": whole * 1000,
            "loop_pass_ms": loop * 1000,
            "layer_call": call is not None,
            "products_ms": products * 1000,
            "gb_s": nbytes / products / 1e9,
            "gflop_s": 2 * params * rows / products / 1e9,
            "pass_gb_s": nbytes / whole / 1e9,
            "pass_gflop_s": 2 * params * rows / whole / 1e9,
            "breakdown_ms": {k: v * 1000 for k, v in med.items()},
        }
    return out


def machine_slug(cpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-") or "machine"


def report(data: dict) -> str:
    m, peaks = data["machine"], data["peaks"]
    lines = [
        f"# Roofline: {m['cpu']}, {m['torch_threads']} threads, {m['simd']}",
        "",
        f"Command: `python scripts/roofline.py --out docs/roofline` (default model, {CONTEXT}-token context, "
        f"fastest of {ROUNDS} rounds).",
        "",
        f"Peaks measured here: streaming read **{peaks['gb_s']:.1f} GB/s**; matrix product "
        f"**{peaks['gflop_s_float32']:.1f} GFLOP/s** float32, **{peaks['gflop_s_bfloat16']:.1f} GFLOP/s** bfloat16 "
        f"(the fastest of a few large products through PyTorch).",
        "",
        "| path | weights | one-row pass | products, 1 row | GB/s (share of peak) | 16-row pass | products, 16 rows "
        "| GFLOP/s (share of peak) | 16 rows / 1 row |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in data["paths"]:
        r1, r16 = p["rows1"], p["rows16"]
        peak_f = peaks[f"gflop_s_{p['dtype']}"]
        lines.append(
            f"| {p['path']} | {p['weight_mb']:.0f} MB | {r1['pass_ms']:.2f} ms | {r1['products_ms']:.2f} ms "
            f"| {r1['gb_s']:.1f} ({r1['gb_s'] / peaks['gb_s']:.0%}) | {r16['pass_ms']:.2f} ms "
            f"| {r16['products_ms']:.2f} ms | {r16['gflop_s']:.0f} ({r16['gflop_s'] / peak_f:.0%}) "
            f"| {r16['pass_ms'] / r1['pass_ms']:.2f}x |")
    calls = [p for p in data["paths"] if p["rows1"].get("layer_call")]
    if calls:
        lines += ["", "The layers as one compiled call against the Python loop over the same kernels (fastest pass of "
                  "each):", "", "| path | rows | one call | Python loop | loop / call |", "|---|---|---|---|---|"]
        for p in calls:
            for rows in (1, 16):
                r = p[f"rows{rows}"]
                lines.append(f"| {p['path']} | {rows} | {r['pass_ms']:.2f} ms | {r['loop_pass_ms']:.2f} ms "
                             f"| {r['loop_pass_ms'] / r['pass_ms']:.2f}x |")
    lines += ["", "Where a pass's time goes (median pass with every part timed, in the Python loop over the "
              "layers; the wrappers add a little):", "",
              "| path | rows | pass | products | attention | norms | rope + cache write | rest |",
              "|---|---|---|---|---|---|---|---|"]
    for p in data["paths"]:
        for rows in (1, 16):
            b = p[f"rows{rows}"]["breakdown_ms"]
            total = b["_total"]
            cells = [f"{b.get(k, 0.0):.2f} ms ({b.get(k, 0.0) / total:.0%})"
                     for k in ("products", "attention", "norms", "rope + cache write", "rest")]
            lines.append(f"| {p['path']} | {rows} | {total:.2f} ms | " + " | ".join(cells) + " |")
    lines += ["", "The memory floor of a one-row pass is its weight bytes over the streaming peak: "
              + ", ".join(f"{p['path']} {p['weight_mb'] / 1e3 / peaks['gb_s'] * 1000:.2f} ms" for p in data["paths"])
              + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/roofline", help="folder for <machine>.json and <machine>.md")
    ap.add_argument("--paths", default=None,
                    help="paths to measure (blocks, panels, bf16, bf16-blocks, bf16-avx512, int8; default: all but "
                         "the last two bfloat16 ones; bf16-blocks joins where bfloat16 reads the blocks, bf16-avx512 "
                         "(AMX off) where the CPU has AMX)")
    args = ap.parse_args()

    from sot.machine import machine_info

    timer = PartTimer()
    instrument(timer)
    machine = machine_info()
    peaks = {"gb_s": peak_bandwidth(), "gflop_s_float32": peak_flops(torch.float32),
             "gflop_s_bfloat16": peak_flops(torch.bfloat16)}
    known = {"blocks": ("float32, 4-bit blocks", torch.float32, {}),
             "panels": ("float32, panels", torch.float32, {"SOT_NO_BLOCKS": "1"}),
             "bf16": ("bfloat16", torch.bfloat16, {}),
             "bf16-blocks": ("bfloat16, blocks only", torch.bfloat16, {"SOT_NO_BF16_PAIRS": "1"}),
             "bf16-avx512": ("bfloat16, AVX512-BF16 (no AMX)", torch.bfloat16, {"SOT_NO_AMX": "1"}),
             "int8": ("int8 products, 4-bit blocks", torch.float32, {})}
    from sot.kernels.linear import bf16_blocks_supported

    paths = []
    from sot.kernels import cpu_kernels

    amx = cpu_kernels() is not None and cpu_kernels().amx_supported()
    keys = args.paths or ("blocks,panels,bf16,bf16-avx512,int8" if amx else "blocks,panels,bf16,bf16-blocks,int8"
                          if bf16_blocks_supported() else "blocks,panels,bf16,int8")
    for key in keys.split(","):
        name, dtype, env = known[key.strip()]
        paths.append(measure_path(name, dtype, env, timer, int8=key.strip() == "int8"))
        print(f"{name}: one row {paths[-1]['rows1']['pass_ms']:.2f} ms, 16 rows {paths[-1]['rows16']['pass_ms']:.2f} ms",
              flush=True)
    data = {"machine": machine, "peaks": peaks, "paths": paths}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # (machines of one name and vector width differ in their bfloat16 instructions)
    kernel = cpu_kernels()
    bf16 = "-amx" if kernel is not None and kernel.amx_supported() else "-bf16" if bf16_blocks_supported() else ""
    slug = machine_slug(f"{machine['cpu']}-{machine['simd']}{bf16}")
    (out / f"{slug}.json").write_text(json.dumps(data, indent=1))
    (out / f"{slug}.md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
