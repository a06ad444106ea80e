"""Compare state predictors on the target's own answers, without timing noise.

For every answer of a `sot bench` run's `plain.jsonl` (the target's greedy output), the target
states are computed once and each predictor is unrolled on them, teacher-forced. Two numbers
come out per predictor, for a single greedy chain of `--depth` tokens:

- teacher-forced chain: the mean accepted length over a chain started at every answer position
  (the trainer's held-out figure);
- decoding walk tau: the tokens per step of greedy decoding with that chain, walking the answer
  as the engine does (a step accepts a run and adds the target's bonus token, and the next chain
  starts after it). Hard stretches take many steps, so this is below the teacher-forced mean;
  it equals what `sot bench --policy static --draft-top-k 1 --no-lookup` measures.

Usage: .venv/bin/python -m sot.analysis.walk_acceptance BENCH_DIR SET [SET ...] --predictors a.safetensors,b.safetensors
(BENCH_DIR/SET/plain.jsonl must exist, e.g. docs/bench/stage8 humaneval sharegpt-heldout)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sot.bench.prompts import load_prompt_set
from sot.drafters.state import load_predictor
from sot.models.loading import load_model
from sot.prompts import encode
from sot.train.data import target_states


def chain_runs(hits: list[list[bool]], start: int, stop: int, depth: int) -> tuple[list[int], int, int]:
    """``hits[k][r]``: the depth-``k`` prediction of row ``r`` is the target's token. Returns
    the accepted length of a chain at every row in ``[start, stop)``, and the tokens and steps
    of a greedy walk from ``start``."""
    def run(r: int) -> int:
        a = 0
        while a < depth and hits[a][r + a]:
            a += 1
        return a

    every = [run(r) for r in range(start, stop)]
    r, steps, tokens = start, 0, 0
    while r < stop:
        a = run(r)
        steps, tokens, r = steps + 1, tokens + a + 1, r + a + 1
    return every, tokens, steps


@torch.no_grad()
def walk_answer(pred, states: torch.Tensor, ids: list[int], prompt_len: int, head: torch.Tensor,
                depth: int) -> tuple[list[int], int, int, list[tuple[int, int]]]:
    """One answer: ``states [T, S + 1, D]`` (:func:`~sot.train.data.target_states` of ``ids``),
    the prompt's length and the target's head ``[V, D]``. Returns the chain at every answer
    row, the walk's tokens and steps, and the walk's chains as ``(start row, accepted)``."""
    s, t = states.shape[1] - 1, len(ids) - 1
    top = (states[1:, s] @ head.T).argmax(-1)  # the target's token after each row's next position
    outs = pred.forward_unrolled(states[:t, :s].unsqueeze(0).to(next(pred.parameters()).dtype),
                                 torch.tensor(ids[1:]).unsqueeze(0), depth)
    hits = torch.stack([pred.draft_vocab[pred.logits(g[0]).argmax(-1)] == top for g in outs]).tolist()
    start, stop = prompt_len - 1, t - depth
    every, tokens, steps = chain_runs(hits, start, stop, depth)
    walked, r = [], start
    while r < stop:
        a = every[r - start]
        walked.append((r, a))
        r += a + 1
    return every, tokens, steps, walked


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_dir")
    ap.add_argument("sets", nargs="+")
    ap.add_argument("--predictors", required=True, help="comma list of predictor files")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    preds = {p: load_predictor(p, model) for p in args.predictors.split(",")}
    layers = tuple(next(iter(preds.values())).config.state_layers)
    head = model.get_output_embeddings().weight.float()
    d = args.depth
    for name in args.sets:
        records = [json.loads(line) for line in (Path(args.bench_dir) / name / "plain.jsonl").read_text().splitlines()]
        items = {str(it["id"]): it for it in load_prompt_set(name, limit=None)}
        totals = {p: [0, 0, 0, 0] for p in preds}
        for rec in records:
            prompt = encode(tok, items[str(rec["question_id"])], True)
            ids = prompt + rec["choices"][0]["turns"][0]
            states = target_states(model, ids, layers).float()  # [T, S + 1, D]
            for p, pred in preds.items():
                every, tokens, steps, _ = walk_answer(pred, states, ids, len(prompt), head, d)
                acc = totals[p]
                acc[0], acc[1], acc[2], acc[3] = acc[0] + sum(every), acc[1] + len(every), acc[2] + tokens, acc[3] + steps
        for p, (accepted, positions, tokens, steps) in totals.items():
            print(f"{name:17s} {p}: teacher-forced chain {1 + accepted / max(positions, 1):.3f}, "
                  f"decoding walk tau {tokens / max(steps, 1):.3f} ({positions} positions, {len(records)} answers)")


if __name__ == "__main__":
    main()
