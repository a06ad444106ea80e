"""Upper bound on the speed-up of tree drafting when sampling, on this machine.

SoT drafts fixed tokens (a tree of one-hot proposals) and verifies them by coupled or
recursive rejection sampling. Either way a node is accepted exactly when the target's sample passes through
it, so its acceptance probability is the product of the target's probabilities along its
path, whatever the drafter. The expected accepted length of a tree is the sum of those
products, and the best tree of ``n`` nodes holds the ``n`` most probable prefixes. This script
finds that tree by best-first search with the target itself (an oracle drafter), at positions
of sampled continuations of real prompts, and combines it with the verify-time curve measured
on this machine:

    speed-up <= max_n (1 + E[accepted | best n-node tree]) * verify(1 row) / verify(n + 1 rows)

Drafting time is ignored, so no drafter of fixed-token trees can do better. (Drafts sampled
from the drafter's own distribution ``q`` are accepted with probability ``1 - TV(p, q)`` per
step instead; that beats the one-hot top token only as far as ``q`` matches the target.)

    python -m sot.analysis.oracle_bound --prompts sharegpt-heldout --limit 8 --out docs/bench/oracle-t1/sharegpt-heldout
"""
from __future__ import annotations

import argparse
import heapq
import json
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from sot.bench.prompts import load_prompt_set
from sot.models.adapter import TargetModel
from sot.models.loading import load_model
from sot.policy import CostModel
from sot.prompts import encode
from sot.sampling import SamplingParams, target_probs


@torch.no_grad()
def best_tree_gains(model, context: torch.Tensor, params: SamplingParams, nodes: int) -> list[float]:
    """``E[accepted]`` of the best tree of ``1..nodes`` non-root nodes after ``context [T]``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(context[None], past_key_values=cache, use_cache=True)

    def children(path: list[int], probs: torch.Tensor, base: float):
        top = torch.topk(probs, min(nodes, probs.numel()))
        for p, tok in zip(top.values.tolist(), top.indices.tolist()):
            yield -(base * p), path + [tok]

    heap = list(children([], target_probs(out.logits[0, -1:].float(), params)[0], 1.0))
    heapq.heapify(heap)
    gains, total = [], 0.0
    while len(gains) < nodes and heap:
        neg, path = heapq.heappop(heap)
        total += -neg
        gains.append(total)
        if len(gains) == nodes:
            break
        step = model(torch.tensor([path]), past_key_values=cache, use_cache=True)
        cache.crop(-len(path))  # back to the context
        for item in children(path, target_probs(step.logits[0, -1:].float(), params)[0], -neg):
            heapq.heappush(heap, item)
    return gains


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=64, help="sampled continuation per prompt")
    ap.add_argument("--every", type=int, default=4, help="measure at every k-th position of it")
    ap.add_argument("--nodes", type=int, default=31, help="largest tree, root excluded")
    ap.add_argument("--out", required=True)
    ap.add_argument("--state-cache", default=None, metavar="FOLDER",
                    help="also measure a predictor on this held-out state cache (e.g. "
                         "runs/data/sharegpt/eval): its top token's target probability against 1 - TV")
    ap.add_argument("--predictor", default=None, help="predictor file for --state-cache (default: the shipped one)")
    ap.add_argument("--remeasure", action="store_true",
                    help="keep the trees of OUT/oracle.json and only measure the verify times again")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)

    loaded = load_model("default", dtype=torch.bfloat16)
    model, tok = loaded.model, loaded.tokenizer
    out = Path(args.out)
    if args.remeasure:
        kept = json.loads((out / "oracle.json").read_text())
        for key in ("prompts", "limit", "temperature", "tokens", "every", "nodes"):
            setattr(args, key, kept["config"][key])
        positions, mean = kept["positions"], [r["tau"] - 1.0 for r in kept["rows"][1:]]
    else:
        positions, mean = search(model, tok, args)
    report(model, args, positions, mean, out)
    if args.state_cache:
        drafter_acceptance(model, args, out)


@torch.no_grad()
def drafter_acceptance(model, args, out: Path, depths: int = 4, sequences: int = 24) -> None:
    """On held-out rows of a state cache, unroll the predictor along the text and compare,
    per depth, the target's probability of the predictor's top token (what a one-hot draft is
    accepted with) with ``1 - TV(p, q)`` (what a draft sampled from the predictor is accepted with)."""
    from sot.drafters import DEFAULT_PREDICTOR
    from sot.drafters.state import load_predictor
    from sot.train.data import StateDataset

    path = Path(args.predictor) if args.predictor else DEFAULT_PREDICTOR
    pred = load_predictor(path, model).float()
    head = model.get_output_embeddings().weight.detach().float()
    params = SamplingParams(temperature=args.temperature)
    data = StateDataset(args.state_cache)
    sums = [[0.0, 0.0, 0] for _ in range(depths)]
    for i in tqdm(range(min(sequences, len(data))), desc="predictor rows", unit="seq"):
        tokens, mask, states = data[i]
        s, t = states.shape[1] - 1, tokens.shape[0] - 1
        p = target_probs(states[1:, s].float() @ head.T, params).float()  # [t, V]
        outs = pred.forward_unrolled(states[:t, :s].unsqueeze(0).float(), tokens[1:].unsqueeze(0), depths)
        rows = torch.nonzero(mask[1 : t + 1].bool()).flatten()
        for k, g in enumerate(outs):
            r = rows[rows >= k]
            q_draft = target_probs(pred.logits(g[0, r]), params).float()
            q = torch.zeros(len(r), head.shape[0])
            q[:, pred.draft_vocab] = q_draft
            top = pred.draft_vocab[q_draft.argmax(-1)]
            sums[k][0] += float(p[r].gather(1, top[:, None]).sum())
            sums[k][1] += float(torch.minimum(p[r], q).sum())
            sums[k][2] += len(r)
    rows_out = [{"depth": k, "top_token": a / n, "sampled": b / n, "rows": n} for k, (a, b, n) in enumerate(sums)]
    (out / "predictor.json").write_text(json.dumps({"predictor": str(path), "depths": rows_out}, indent=1))
    for r in rows_out:
        print(f"depth {r['depth']}: target probability of the predictor's top token {r['top_token']:.3f}, "
              f"1 - TV {r['sampled']:.3f} ({r['rows']} rows)")


def search(model, tok, args) -> tuple[int, list[float]]:
    """Sample continuations and find the best trees along them; returns the number of
    positions and the mean ``E[accepted]`` for ``1..nodes`` nodes."""
    params = SamplingParams(temperature=args.temperature)
    gen = torch.Generator().manual_seed(0)
    curves = []
    records = load_prompt_set(args.prompts, args.limit)
    bar = tqdm(total=len(records) * (args.tokens // args.every), desc="oracle trees", unit="pos")
    for record in records:
        ids = torch.tensor(encode(tok, record, chat=True))
        for t in range(args.tokens):
            if t % args.every == 0:
                curves.append(best_tree_gains(model, ids, params, args.nodes))
                bar.update()
            logits = model(ids[None]).logits[0, -1:].float()
            nxt = torch.multinomial(target_probs(logits, params)[0], 1, generator=gen)
            if int(nxt) == tok.eos_token_id:
                break
            ids = torch.cat([ids, nxt])
    bar.close()
    n = min(len(c) for c in curves)
    return len(curves), [sum(c[i] for c in curves) / len(curves) for i in range(n)]


def report(model, args, positions: int, mean: list[float], out: Path) -> None:
    """Measure the verify-time curve and write ``oracle.json`` and ``report.md`` to ``out``."""
    n = len(mean)
    cost = CostModel.measure(TargetModel(model), args.nodes + 1, repeats=10)
    rows = []
    for k in range(n + 1):
        tau = 1.0 + (mean[k - 1] if k else 0.0)
        rows.append({"nodes": k, "tau": tau, "verify_ratio": cost.verify(k + 1) / cost.verify(1),
                     "speedup_bound": tau * cost.verify(1) / cost.verify(k + 1)})
    best = max(rows, key=lambda r: r["speedup_bound"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle.json").write_text(json.dumps({"config": vars(args), "positions": positions,
                                                  "rows": rows, "best": best}, indent=1))
    lines = [f"# Oracle bound: {args.prompts}, temperature {args.temperature}", "",
             (f"{positions} positions of sampled continuations, {args.limit} prompts. "
              "`tau`: 1 + expected accepted tokens of the best tree of that many nodes, drafted by the "
              "target itself; `verify`: verify time of its rows over one row's, measured here."), "",
             "| draft nodes | tau bound | verify time ratio | speed-up bound vs plain |", "|---|---|---|---|"]
    for r in rows:
        if r["nodes"] in (0, 1, 2, 3, 4, 6, 8, 11, 15, 23, 31) or r is best:
            lines.append(f"| {r['nodes']} | {r['tau']:.2f} | {r['verify_ratio']:.2f} | {r['speedup_bound']:.2f}x |")
    lines += ["", f"Best: {best['nodes']} nodes, at most {best['speedup_bound']:.2f}x plain decoding (tau {best['tau']:.2f})."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
