"""SoT's lean forward against the generic path on one loaded model, side by side; or against
itself with a GGUF file's Q4_K and Q6_K weights as float32 panels instead of their blocks.

The generic path runs the transformers modules with SoT's attention, norms and products plugged
in; the lean forward (``sot/models/fast_llama.py``: the Llama family and Gemma 3) runs the same
kernels without the modules, its layers in one compiled call. Both engines share the model's
weights (``--against panels``: the model is loaded twice, once without the file's K-quant
blocks, ``sot.models.gguf_blocks``) and take turns prompt by prompt (the order alternating), so
a busy moment on the machine slows each alike.

Prints, per path: decoding's tokens/s alone (the tokens after the first over the time after
it), its ratio to the first's, the median time to the first token, tau, and how many answers
equal the first's token for token (against the generic path they must all: the two give the
same bits; the blocks' products round differently from float32 panels').

    python scripts/fast_path_ab.py --model PATH/gemma-3-270m-q4_k_m.gguf --set sharegpt-heldout --limit 8
    python scripts/fast_path_ab.py --model PATH/gemma-3-270m-q4_k_m.gguf --against panels --tokens 128
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sot.models.gguf_blocks as gguf_blocks  # noqa: E402
from sot.api import SoT  # noqa: E402
from sot.bench.prompts import load_prompt_set  # noqa: E402
from sot.bench.report import arms_table  # noqa: E402
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
    ap.add_argument("--against", default="generic", choices=("generic", "panels"),
                    help="the other arm: the generic path, or the lean forward without the file's K-quant blocks")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
    if args.against == "panels":
        attach = gguf_blocks.attach_k_quant_blocks
        gguf_blocks.attach_k_quant_blocks = lambda model, path: 0
        plain = load_model(args.model, dtype=resolve_dtype(args.dtype))
        gguf_blocks.attach_k_quant_blocks = attach
        arms = (("panels", plain, True), ("blocks", loaded, True))
    else:
        arms = (("generic", loaded, False), ("fast", loaded, True))
    engines = {}
    for name, arm, fast in arms:
        target = TargetModel(arm.model, fast=fast)
        if fast and target.fast is None:
            print(f"{loaded.name} has no lean forward here; nothing to compare", file=sys.stderr)
            return 1
        engine = Engine(target, make_drafter(args.drafter, arm.model), decode=decoder(arm.tokenizer, True))
        engines[name] = SoT(target, arm.tokenizer, engine, arm.name)
    names = list(engines)
    prompts = load_prompt_set(args.set, limit=args.limit)
    got: dict[str, list] = {name: [] for name in names}
    for i, record in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            sot = engines[name]
            out = sot.generate_ids([sot.encode(record)], sot.params(max_new_tokens=args.tokens))[0]
            got[name].append(out)
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    print(f"{loaded.name}, {args.dtype}, drafter {args.drafter}, {args.set} x {len(prompts)}, {args.tokens} tokens")
    print(arms_table(got, "path"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
