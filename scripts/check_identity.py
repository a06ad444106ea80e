#!/usr/bin/env python
"""Check on a real model file that speculative decoding gives plain decoding's output.

For each dtype, greedy completions of a few raw prompts are decoded plainly, with prompt
lookup, and with an untrained state predictor (random drafts that are mostly rejected, so
verification and rollback run every step), each prompt alone and all in one batch. In
float32 they are also compared with Hugging Face ``generate``. Prints one line per check
and exits non-zero on any difference.

    python scripts/check_identity.py --model path/to/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import sys

import torch

from sot.drafters import NoDrafter, PromptLookupDrafter, TreeBudget
from sot.drafters.state import StateDrafter, new_predictor
from sot.engine import Engine, GenerationParams
from sot.models.adapter import TargetModel
from sot.models.loading import load_model

PROMPTS = (
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
)


def shrink_windows(model: torch.nn.Module, window: int) -> None:
    """Give every sliding layer of ``model`` (and its config) the window ``window``."""
    if not getattr(model.config, "sliding_window", None):
        raise SystemExit(f"{model.config.model_type} has no sliding layers")
    model.config.sliding_window = window
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = window


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt", action="append", help="a raw completion prompt (repeatable; default: three)")
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="shrink the model's sliding layers to this window, so that it cuts within short "
                         "answers (the model then differs from the file's; plain and speculative must still agree)")
    args = ap.parse_args()
    prompts_text = args.prompt or list(PROMPTS)
    params = GenerationParams(max_new_tokens=args.max_new_tokens)  # no end token: a fixed length
    failures = 0

    def check(name: str, got: list[list[int]], want: list[list[int]]) -> None:
        nonlocal failures
        same = got == want
        failures += not same
        print(f"  {name:<34} {'identical' if same else 'DIFFERENT'}", flush=True)

    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        loaded = load_model(args.model, dtype=dtype)
        tok = loaded.tokenizer
        if args.sliding_window:
            shrink_windows(loaded.model, args.sliding_window)
        prompts = [tok(p)["input_ids"] for p in prompts_text]
        reference = None
        if dtype == torch.float32:  # before SoT wraps the model's attention
            reference = []
            for p in prompts:
                out = loaded.model.generate(torch.tensor([p]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                            min_new_tokens=args.max_new_tokens)
                reference.append(out[0, len(p):].tolist())
        layers = (1, loaded.model.config.num_hidden_layers // 2, loaded.model.config.num_hidden_layers)
        target = TargetModel(loaded.model, state_layers=layers)
        config = loaded.model.config
        windows = sorted({w for w in (getattr(a.self_attn, "sliding_window", None) for a in loaded.model.model.layers) if w})
        print(f"{loaded.name} {dtype_name}: {config.model_type}, {config.num_hidden_layers} layers, "
              f"sliding windows {windows or 'none'}, prompts of {[len(p) for p in prompts]} tokens", flush=True)

        def run(drafter, batch: list[list[int]]) -> list[list[int]]:
            engine = Engine(target, drafter, TreeBudget(16, 6))
            return [r.token_ids for r in engine.generate(batch, params)]

        plain = [run(NoDrafter(), [p])[0] for p in prompts]
        for p, ids in zip(prompts_text, plain):
            print(f"  {p[:30]!r:<34} -> {tok.decode(ids)[:60]!r}")
        check("plain, one batch", run(NoDrafter(), prompts), plain)
        check("pld, each alone", [run(PromptLookupDrafter(), [p])[0] for p in prompts], plain)
        check("pld, one batch", run(PromptLookupDrafter(), prompts), plain)
        predictor = new_predictor(loaded.model, layers, None, seed=0)
        check("state (untrained), one batch", run(StateDrafter(predictor, top_k=3), prompts), plain)
        if reference is not None:
            check("transformers generate()", plain, reference)
    print("all identical" if not failures else f"{failures} check(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
