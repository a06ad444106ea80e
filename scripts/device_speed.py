"""What a verify row costs on a device, and what speculation gives there, on a random model of
the default model's shape (SmolLM2-135M: 30 layers, width 576, 9 heads, 3 KV heads; no
weights need to travel to the device).

1. The cost curve: a verify pass of 1 to 128 rows after a 512-token context, in ms and as a
   multiple of one row (``CostModel.measure``: minimum of 5 rounds).
2. Plain decoding against an oracle chain drafter (the reference answer's next tokens, each
   kept with probability ``--hit``, so the accepted length is known), side by side on the same
   prompts, batch 1 and 8: tokens/s, their ratio, mean tokens per step, and whether every
   output is identical.

Both with verify passes replayed as CUDA graphs and eager, side by side (``--graphs``), and
the time to read a 1024-token prompt with each.

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


def prompt_reading(targets: dict[str, TargetModel], vocab: int, tokens: int = 1024, rounds: int = 3) -> None:
    """Reading a ``tokens``-long prompt into a fresh cache (``TargetModel.prefill``, chunks of
    ``PREFILL_CHUNK``), each target in turn, best of ``rounds``."""
    prompt = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(2))
    best = dict.fromkeys(targets, float("inf"))
    for _ in range(rounds):
        for mode, target in targets.items():
            cache = target.new_cache(1, tokens + 64)
            target.synchronize()
            t0 = time.perf_counter()
            target.prefill(cache, 0, prompt)
            target.synchronize()
            best[mode] = min(best[mode], time.perf_counter() - t0)
    print(f"reading a {tokens}-token prompt: " + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hit", type=float, default=0.8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--graphs", choices=["both", "on", "off"], default="both",
                    help="verify passes as CUDA graphs, eager, or both side by side (default)")
    ap.add_argument("--profile", action="store_true",
                    help="then profile plain decoding at batch 1: Python functions (cProfile) and kernels "
                         "(torch.profiler)")
    args = ap.parse_args()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model = model.to(DTYPES[args.dtype]).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), {args.dtype}, torch {torch.__version__}, transformers {transformers.__version__}")
    modes = {"both": ("eager", "graphs"), "on": ("graphs",), "off": ("eager",)}[args.graphs]
    targets = {mode: TargetModel(model, cuda_graphs=mode == "graphs") for mode in modes}

    for mode, target in targets.items():
        cost = CostModel.measure(target, 128, context=512, sizes=[1, 2, 4, 8, 16, 32, 64, 128])
        one = cost.verify(1)
        print(f"verify rows ({mode}):  " + "  ".join(f"{r}: {cost.verify(r) * 1e3:.2f} ms ({cost.verify(r) / one:.2f}x)"
                                                   for r in [1, 2, 4, 8, 16, 32, 64, 128]))
    prompt_reading(targets, SHAPE["vocab_size"])

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = GenerationParams(max_new_tokens=args.new_tokens)
    budget = TreeBudget(args.depth + 1, args.depth)
    first = targets[modes[0]]
    reference = [r.token_ids for r in Engine(first, NoDrafter(), budget).generate(prompts[:1], params)]  # warm-up
    reference = [r.token_ids for r in Engine(first, NoDrafter(), budget).generate(prompts, params, 8)]
    lengths = [len(p) for p in prompts]
    labels = [(mode, drafter) for mode in modes for drafter in ("plain", "oracle")]
    for batch in (1, 8):
        seconds = dict.fromkeys(labels, 0.0)
        steps, tokens, same = 0, 0, True
        for _ in range(2):  # alternating rounds
            for mode, label in labels:
                drafter = NoDrafter() if label == "plain" else OracleChain(reference, lengths, args.hit, args.depth)
                target = targets[mode]
                engine = Engine(target, drafter, budget)
                target.synchronize()
                t0 = time.perf_counter()
                out = engine.generate(prompts, params, batch)
                target.synchronize()
                seconds[mode, label] += time.perf_counter() - t0
                same &= [r.token_ids for r in out] == reference
                if label == "oracle":
                    steps += sum(r.steps for r in out)
                    tokens += sum(len(r.token_ids) for r in out)
        total = 2 * sum(len(r) for r in reference)
        speed = {k: total / v for k, v in seconds.items()}
        for mode in modes:
            plain, oracle = speed[mode, "plain"], speed[mode, "oracle"]
            print(f"batch {batch}, {mode}: plain {plain:.1f} tok/s, oracle chain (hit {args.hit}, depth {args.depth}) "
                  f"{oracle:.1f} tok/s: {oracle / plain:.2f}x")
        if len(modes) == 2:
            gain = {label: speed["graphs", label] / speed["eager", label] for label in ("plain", "oracle")}
            print(f"batch {batch}: graphs against eager, plain {gain['plain']:.2f}x, "
                  f"oracle chain {gain['oracle']:.2f}x")
        print(f"batch {batch}: tokens per step {tokens / steps:.2f}; every output identical {same}")
        graphs = targets.get("graphs")
        if graphs is not None and graphs.graphs is not None:
            print(f"graphs: {graphs.graphs.replays} replays, {len(graphs.graphs.graphs)} kept, failed: "
                  f"{graphs.graphs.failed}")
    if args.profile:
        import cProfile
        import pstats

        target = targets[modes[-1]]
        profile = cProfile.Profile()
        profile.enable()
        Engine(target, NoDrafter(), budget).generate(prompts[:2], params, 1)
        target.synchronize()
        profile.disable()
        print(f"profile of plain decoding, batch 1, 2 prompts ({modes[-1]}):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as kernel_profile

        gpu = device.type == "cuda"
        with kernel_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            Engine(target, NoDrafter(), budget).generate(prompts[:1], GenerationParams(max_new_tokens=32), 1)
            target.synchronize()
        print(f"kernels of 32 plain steps, batch 1 ({modes[-1]}):")
        for key in (["self_device_time_total", "self_cuda_time_total"] if gpu else ["self_cpu_time_total"]):
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
                break
            except (AttributeError, KeyError, ValueError):
                continue


if __name__ == "__main__":
    main()
