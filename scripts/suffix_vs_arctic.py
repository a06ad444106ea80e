"""SoT's suffix drafter against arctic-inference's ``SuffixDecodingCache`` (the implementation
vLLM calls for ``method: "suffix"``), side by side in one process on the same conversations.

Both run through SoT's engine and commit policy, each with its own global store built over
the run; only the drafts differ. Prints tau and tokens/s per set and method, and checks that
both outputs equal plain decoding.

    python scripts/suffix_vs_arctic.py --sets code-edit-multiturn,agent-loop --limit 4

arctic-inference builds from source (C++20, nanobind); see docs/NOTEBOOK.md for how it was
built here. Without it the script says so and exits 2.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from sot.drafters import NoDrafter, SuffixDrafter, TreeBudget
from sot.drafters.base import DraftInput, Drafter, DrafterKind
from sot.tree import DraftTree


class ArcticSuffixDrafter(Drafter):
    """arctic-inference's suffix cache behind SoT's drafter interface: a request starts its
    local tree at its first step, each step adds the tokens committed since, and a finished
    request's answer stays in the global tree (vLLM's defaults: depth 24, factor 1.0,
    min probability 0.1, tree speculation on so that it proposes trees, as SoT's does)."""

    kind = DrafterKind.SUFFIX

    def __init__(self, max_depth: int = 24, max_cached: int = 10000) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached)
        self.max_depth = max_depth
        self.seen: dict[int, int] = {}  # per sequence: context tokens given to the cache
        self.prompts: dict[int, int] = {}
        self.next_id = 0
        self.ids: dict[int, str] = {}

    def reset(self, batch_size: int = 0) -> None:
        for key in list(self.ids):
            self.release(key)

    def release(self, sequence: int) -> None:
        rid = self.ids.pop(sequence, None)
        if rid is not None and rid in self.cache.active_requests:
            self.cache.stop_request(rid)
        self.seen.pop(sequence, None)

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        out = []
        for x in inputs:
            if x.sequence not in self.ids:
                rid = f"r{self.next_id}"
                self.next_id += 1
                self.ids[x.sequence] = rid
                self.cache.start_request(rid, np.asarray(x.context, dtype=np.int32))
                self.seen[x.sequence] = len(x.context)
            rid = self.ids[x.sequence]
            new = x.context[self.seen[x.sequence]:]
            if new:
                self.cache.add_active_response(rid, np.asarray(new, dtype=np.int32))
                self.seen[x.sequence] = len(x.context)
            pattern = np.asarray(x.context[-self.max_depth:], dtype=np.int32)
            draft = self.cache.speculate(rid, pattern, max_spec_tokens=budget.max_nodes - 1, use_tree_spec=True)
            root = x.context[-1]
            tokens, parents = [root], [-1]
            depths, probs = [0], [1.0]
            ours = {-1: 0}  # the draft's index -> ours (its -1 is our root)
            for i, (tok, par, p) in enumerate(zip(draft.token_ids, draft.parents, draft.probs)):
                node = ours.get(par)
                if node is None or depths[node] + 1 > budget.max_depth:
                    continue  # past the depth limit, or under a node that is
                ours[i] = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                depths.append(depths[node] + 1)
                probs.append(float(p))
            out.append(DraftTree(tokens, parents, depths, probs))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="code-edit-multiturn,agent-loop")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    try:
        ArcticSuffixDrafter()
    except ImportError as exc:
        print(f"arctic-inference is not importable here ({exc}); see docs/NOTEBOOK.md", file=sys.stderr)
        return 2
    from sot.api import SoT
    from sot.bench.conversations import load_conversations, render
    from sot.engine import Engine

    sot = SoT.load(drafter="none")
    target, tok = sot.target, sot.tokenizer
    params = sot.params(max_new_tokens=args.tokens)
    budget = TreeBudget()
    print("| set | method | tok/s | tau | identical to plain |")
    print("|---|---|---|---|---|")
    for name in args.sets.split(","):
        convs = load_conversations(name, args.limit)
        engines = {"plain": Engine(target, NoDrafter(), budget), "sot-suffix": Engine(target, SuffixDrafter(), budget),
                   "arctic-suffix": Engine(target, ArcticSuffixDrafter(), budget)}
        warm = sot.params(max_new_tokens=8)
        for engine in engines.values():  # the verify-cost measurement and first calls, untimed
            engine.generate([sot.encode(render(convs[0], [], True))], warm)
        engines["sot-suffix"].drafter.stores.clear()  # the warm-up's answer drafts nothing
        engines["arctic-suffix"] = Engine(target, ArcticSuffixDrafter(), budget)  # a fresh cache
        answers = {m: [[] for _ in convs] for m in engines}
        outs: dict[str, list] = {m: [] for m in engines}
        secs = {m: 0.0 for m in engines}
        for c, conv in enumerate(convs):
            for _ in conv["turns"]:
                for m, engine in engines.items():
                    ids = sot.encode(render(conv, answers[m][c], True))
                    t0 = time.perf_counter()
                    res = engine.generate([ids], params)[0]
                    secs[m] += time.perf_counter() - t0
                    outs[m].append(res)
                    answers[m][c].append(tok.decode(res.token_ids, skip_special_tokens=True))
        for m in engines:
            tokens = sum(r.new_tokens for r in outs[m])
            tau = sum(sum(r.accept_lengths) for r in outs[m]) / max(1, sum(r.steps for r in outs[m]))
            same = sum(a.token_ids == b.token_ids for a, b in zip(outs[m], outs["plain"]))
            print(f"| {name} | {m} | {tokens / secs[m]:.1f} | {tau:.2f} | {same}/{len(outs[m])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
