"""A/B two checkouts of SoT on the same prompts, alternating, with both models loaded at once.

Each checkout runs in a worker process of its own (its ``sot`` on ``PYTHONPATH``); both stay
loaded for the whole run and take turns prompt by prompt (A then B, then B then A), so a busy
moment on the machine slows both alike. Reports whether the outputs are token-identical and
each method's tokens/s ratio B/A with tau, and the median time to the first token (the prompt's
reading) of each.

    python scripts/ab_checkouts.py --a /tmp/base --b . --set sharegpt-heldout --limit 8

Only one generation runs at a time; the machine's 2 cores are not shared between the two.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time
from sot.api import SoT
from sot.bench.prompts import load_prompt_set
args = json.loads(sys.argv[1])
engines = {m: SoT.load(drafter=m, dtype=args["dtype"]) for m in args["methods"]}
prompts = load_prompt_set(args["set"], limit=args["limit"])
print(json.dumps({"ready": len(prompts)}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    sot = engines[job["method"]]
    ids = sot.encode(prompts[job["prompt"]])
    params = sot.params(max_new_tokens=args["tokens"])
    c = sot.generate_ids([ids], params)[0]
    print(json.dumps({"ids": c.token_ids, "seconds": c.seconds, "tau": c.mean_accept_len,
                      "ttft": c.first_token_seconds}), flush=True)
"""


def start(root: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    spec = {"methods": args.methods.split(","), "set": args.set, "limit": args.limit, "tokens": args.tokens,
            "dtype": args.dtype}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=os.path.abspath(root))
    return proc


def ask(proc: subprocess.Popen, job: dict) -> dict:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("a worker died; see its error above")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the base checkout (a folder with sot/)")
    ap.add_argument("--b", default=".", help="the checkout under test")
    ap.add_argument("--set", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", default="none,state", help="drafters, comma-separated")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    procs, counts = {}, {}
    for k in "ab":  # one after the other: neither builds its kernels while the other times
        procs[k] = start(getattr(args, k), args)
        counts[k] = json.loads(procs[k].stdout.readline())["ready"]
    n = min(counts.values())
    rows = []
    for method in args.methods.split(","):
        tot = {"a": [0, 0.0, [], []], "b": [0, 0.0, [], []]}
        identical = 0
        for i in range(n):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            got = {k: ask(procs[k], {"method": method, "prompt": i}) for k in order}
            identical += got["a"]["ids"] == got["b"]["ids"]
            for k in "ab":
                tot[k][0] += len(got[k]["ids"])
                tot[k][1] += got[k]["seconds"]
                tot[k][2].append(got[k]["tau"])
                tot[k][3].append(got[k]["ttft"])
        speed = {k: tot[k][0] / tot[k][1] for k in "ab"}
        tau = {k: sum(tot[k][2]) / len(tot[k][2]) for k in "ab"}
        ttft = {k: statistics.median(tot[k][3]) for k in "ab"}
        rows.append(f"| {method} | {identical}/{n} | {speed['a']:.1f} | {speed['b']:.1f} | "
                    f"{speed['b'] / speed['a']:.3f} | {tau['a']:.2f} | {tau['b']:.2f} | "
                    f"{ttft['a']:.3f} | {ttft['b']:.3f} |")
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print("| method | identical | A tok/s | B tok/s | B/A | A tau | B tau | A first token s | B first token s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
