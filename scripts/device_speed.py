"""What a verify row costs on a device, and what speculation gives there, on a random model of
the default model's shape (SmolLM2-135M: 30 layers, width 576, 9 heads, 3 KV heads; no
weights need to travel to the device).

1. The cost curve: a verify pass of 1 to 128 rows after a 512-token context, in ms and as a
   multiple of one row (``CostModel.measure``: minimum of 5 rounds).
2. Plain decoding against an oracle chain drafter (the reference answer's next tokens, each
   kept with probability ``--hit``, so the accepted length is known), side by side on the same
   prompts, batch 1 and 8: tokens/s, their ratio, mean tokens per step, and whether every
   output is identical.

    python scripts/device_speed.py --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import transformers

from sot.drafters import NoDrafter, TreeBudget
from sot.drafters.base import DraftInput, Drafter, DrafterKind
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.models.loading import DTYPES, resolve_device
from sot.policy.cost import CostModel
from sot.tree import DraftTree, tree_from_parents

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True)


class OracleChain(Drafter):
    """Drafts the reference answer's next ``depth`` tokens as one chain, each token replaced
    by a wrong one with probability ``1 - hit`` (so acceptance stops there)."""

    kind = DrafterKind.NONE

    def __init__(self, references: list[list[int]], prompt_lengths: list[int], hit: float, depth: int) -> None:
        self.references, self.prompt_lengths, self.hit, self.depth = references, prompt_lengths, hit, depth
        self.rng = random.Random(0)

    def propose(self, inputs: list[DraftInput], budget: TreeBudget) -> list[DraftTree]:
        trees = []
        for x in inputs:
            done = len(x.context) - self.prompt_lengths[x.index]
            ahead = self.references[x.index][done:done + min(self.depth, budget.max_nodes - 1)]
            chain = [t if self.rng.random() < self.hit else (t + 1) % SHAPE["vocab_size"] for t in ahead]
            trees.append(tree_from_parents([x.context[-1], *chain], list(range(-1, len(chain)))))
        return trees


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hit", type=float, default=0.8)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model = model.to(DTYPES[args.dtype]).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), {args.dtype}, torch {torch.__version__}, transformers {transformers.__version__}")
    target = TargetModel(model)

    cost = CostModel.measure(target, 128, context=512, sizes=[1, 2, 4, 8, 16, 32, 64, 128])
    one = cost.verify(1)
    print("verify rows:  " + "  ".join(f"{r}: {cost.verify(r) * 1e3:.2f} ms ({cost.verify(r) / one:.2f}x)"
                                       for r in [1, 2, 4, 8, 16, 32, 64, 128]))

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = GenerationParams(max_new_tokens=args.new_tokens)
    budget = TreeBudget(args.depth + 1, args.depth)
    reference = [r.token_ids for r in Engine(target, NoDrafter(), budget).generate(prompts[:1], params)]  # warm-up
    reference = [r.token_ids for r in Engine(target, NoDrafter(), budget).generate(prompts, params, 8)]
    lengths = [len(p) for p in prompts]
    for batch in (1, 8):
        seconds = {"plain": 0.0, "oracle": 0.0}
        steps, tokens, same = 0, 0, True
        for _ in range(2):  # alternating rounds
            for label in ("plain", "oracle"):
                drafter = NoDrafter() if label == "plain" else OracleChain(reference, lengths, args.hit, args.depth)
                engine = Engine(target, drafter, budget)
                target.synchronize()
                t0 = time.perf_counter()
                out = engine.generate(prompts, params, batch)
                target.synchronize()
                seconds[label] += time.perf_counter() - t0
                same &= [r.token_ids for r in out] == reference
                if label == "oracle":
                    steps += sum(r.steps for r in out)
                    tokens += sum(len(r.token_ids) for r in out)
        total = 2 * sum(len(r) for r in reference)
        plain, oracle = total / seconds["plain"], total / seconds["oracle"]
        print(f"batch {batch}: plain {plain:.1f} tok/s, oracle chain (hit {args.hit}, depth {args.depth}) "
              f"{oracle:.1f} tok/s: {oracle / plain:.2f}x; tokens per step {tokens / steps:.2f}; identical {same}")


if __name__ == "__main__":
    main()
