"""What computing the LM head only for the rows a walk reads saves in one verify pass.

Times a verify pass of an ``n``-node tree (a binary tree after a 256-token context), and the
argmax of ``k`` of its rows, with the logits left to compute (``lazy``) against every row
computed with the pass (``eager``); the two take turns, round after round, and each keeps
its fastest pass. The model is built from a config with random weights (speed does not
depend on the values): ``gemma3-1b`` (262,144 x 1,152 head, transformers' forward) or
``default`` (SoT's default model, SoT's forward).

    python scripts/head_rows_bench.py --model gemma3-1b --rows 1,4,8,16 --read 2
"""
from __future__ import annotations

import argparse
import time

import torch


def build(name: str, dtype: torch.dtype):
    from sot.models.adapter import TargetModel

    if name == "default":
        from sot import SoT

        return SoT.load("default", drafter="none", dtype="bfloat16").engine.target
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              max_position_embeddings=32768, query_pre_attn_scalar=256)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Gemma3ForCausalLM(config).to(dtype).eval()
    return TargetModel(model)


def main() -> None:
    from sot.attention import build_tree_layout
    from sot.tree import ancestor_table, tree_from_parents

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-1b", choices=["gemma3-1b", "default"])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--read", type=int, default=2, help="rows whose argmax the walk reads")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    target = build(args.model, torch.bfloat16)
    context = 256
    sizes = [int(x) for x in args.rows.split(",")]
    cache = target.new_cache(1, context + max(sizes) + 32)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    target.prefill(cache, 0, prompt)
    cache.set_length(0, context)
    passes = {}
    for n in sizes:
        tree = tree_from_parents(prompt[-n:].tolist(), [-1] + [(i - 1) // 2 for i in range(1, n)])
        rows = -(-n // target.row_multiple) * target.row_multiple
        ids = torch.full((1, rows), int(tree.tokens[0]))
        ids[0, :n] = torch.tensor(tree.tokens)
        pos = torch.full((1, rows), context)
        pos[0, :n] = torch.tensor(tree.depths) + context
        passes[n] = (ids, pos, build_tree_layout(cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], rows,
                                                 cache))
    best = {(n, lazy): float("inf") for n in sizes for lazy in (True, False)}
    for r in range(args.rounds + 1):
        for n in sizes:
            for lazy in ((True, False) if r % 2 else (False, True)):
                target.lazy_head = lazy
                ids, pos, layout = passes[n]
                t0 = time.perf_counter()
                out = target.verify(cache, ids, pos, layout)
                out.argmax_rows(list(range(min(args.read, n))))
                if r:
                    best[(n, lazy)] = min(best[(n, lazy)], time.perf_counter() - t0)
    print(f"{args.model}, bfloat16, the walk reads {args.read} row(s); fastest of {args.rounds} rounds")
    print("| tree rows | every row's head, ms | the read rows' head, ms | saved |")
    print("|---|---|---|---|")
    for n in sizes:
        e, z = best[(n, False)] * 1e3, best[(n, True)] * 1e3
        print(f"| {n} | {e:.1f} | {z:.1f} | {1 - z / e:.0%} |")


if __name__ == "__main__":
    main()
