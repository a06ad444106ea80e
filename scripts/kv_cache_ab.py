"""KV cache dtypes side by side: the same model and drafter with its cache in each of
``--kv`` (``--kv-cache-dtype``), all loaded in one process, taking turns prompt by prompt (the
order rotating), so a busy moment on the machine slows each alike.

Prints, per cache dtype: decoding's tokens/s alone (the tokens after the first over the time
after it; with long prompts, reading them is most of a request), its ratio to the first dtype's,
the median time to the first token, tau, and how many answers equal the first dtype's token for
token (a smaller cache rounds the keys and values, so answers may part; speculation stays exact
in each).

    python scripts/kv_cache_ab.py --set long-context --limit 6 --tokens 128 --kv float32,float16,bfloat16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sot.api import SoT  # noqa: E402
from sot.bench.prompts import load_prompt_set  # noqa: E402
from sot.bench.report import arms_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="long-context", help="a built-in prompt set or a JSONL file")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv", default="float32,float16,bfloat16", help="cache dtypes, comma-separated")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    kinds = args.kv.split(",")
    engines = {kv: SoT.load(drafter=args.drafter, dtype=args.dtype, kv_cache_dtype=kv) for kv in kinds}
    prompts = load_prompt_set(args.set, limit=args.limit)
    got: dict[str, list] = {kv: [] for kv in kinds}
    for i, record in enumerate(prompts):
        for kv in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            sot = engines[kv]
            out = sot.generate_ids([sot.encode(record)], sot.params(max_new_tokens=args.tokens))[0]
            got[kv].append(out)
        print(f"prompt {i + 1}/{len(prompts)}: {len(engines[kinds[0]].encode(record))} tokens", file=sys.stderr)
    print(arms_table(got, "KV cache"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
