"""SoT's lean forward against the generic path on one loaded model, side by side.

The generic path runs the transformers modules with SoT's attention, norms and products plugged
in; the lean forward (``sot/models/fast_llama.py``: the Llama family and Gemma 3) runs the same
kernels without the modules, its layers in one compiled call. Both engines share the model's
weights and take turns prompt by prompt (the order alternating), so a busy moment on the
machine slows each alike.

Prints, per path: decoding's tokens/s alone (the tokens after the first over the time after
it), its ratio to the generic path's, the median time to the first token, tau, and how many
answers equal the generic path's token for token (they must all: the two give the same bits).

    python scripts/fast_path_ab.py --model PATH/gemma-3-270m-q4_k_m.gguf --set sharegpt-heldout --limit 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sot.api import SoT  # noqa: E402
from sot.bench.prompts import load_prompt_set  # noqa: E402
from sot.detokenize import decoder  # noqa: E402
from sot.drafters import make_drafter  # noqa: E402
from sot.engine import Engine  # noqa: E402
from sot.models.adapter import TargetModel  # noqa: E402
from sot.models.loading import load_model, resolve_dtype  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--set", default="sharegpt-heldout", help="a built-in prompt set or a JSONL file")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", default="none", choices=("none", "pld", "suffix"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
    engines = {}
    for name, fast in (("generic", False), ("fast", True)):
        target = TargetModel(loaded.model, fast=fast)
        if fast and target.fast is None:
            print(f"{loaded.name} has no lean forward here; nothing to compare", file=sys.stderr)
            return 1
        engine = Engine(target, make_drafter(args.drafter, loaded.model), decode=decoder(loaded.tokenizer, True))
        engines[name] = SoT(target, loaded.tokenizer, engine, loaded.name)
    names = list(engines)
    prompts = load_prompt_set(args.set, limit=args.limit)
    got: dict[str, list] = {name: [] for name in names}
    for i, record in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            sot = engines[name]
            out = sot.generate_ids([sot.encode(record)], sot.params(max_new_tokens=args.tokens))[0]
            got[name].append(out)
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    rate = {name: sum(len(o.token_ids) - 1 for o in outs) / sum(o.seconds - o.first_token_seconds for o in outs)
            for name, outs in got.items()}
    print(f"{loaded.name}, {args.dtype}, drafter {args.drafter}, {args.set} x {len(prompts)}, {args.tokens} tokens")
    print("| path | decode tok/s | vs generic | first token s | tau | answers equal to generic's |")
    print("|---|---|---|---|---|---|")
    for name, outs in got.items():
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, got["generic"]))
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate['generic']:.2f}x | "
              f"{statistics.median(o.first_token_seconds for o in outs):.3f} | "
              f"{statistics.mean(o.mean_accept_len for o in outs):.2f} | {same}/{len(outs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
