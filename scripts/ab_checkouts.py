"""A/B two checkouts of SoT on the same prompts, alternating, with both models loaded at once.

Each checkout runs in a worker process of its own (its ``sot`` on ``PYTHONPATH``); both stay
loaded for the whole run and take turns prompt by prompt (A then B, then B then A), so a busy
moment on the machine slows both alike. Reports whether the outputs are token-identical and
each method's tokens/s ratio B/A with tau, the same for decoding alone (the tokens after the
first over the time after it: with long prompts, reading them is most of a request's time), and
the median time to the first token (the prompt's reading) of each.

    python scripts/ab_checkouts.py --a /tmp/base --b . --set sharegpt-heldout --limit 8

A multi-turn set (``code-edit-multiturn``, ``agent-loop``, ``sharegpt-multiturn``) runs as
conversations: each checkout answers every turn from its own earlier answers (as ``sot bench``
does), the checkouts take turns per turn, and the table has a row per method and turn.

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
try:
    from sot.bench.conversations import MULTITURN_SETS, load_conversations, render
except ImportError:  # a checkout from before the multi-turn sets
    MULTITURN_SETS = ()
args = json.loads(sys.argv[1])
engines = {m: SoT.load(args["model"], drafter=m, dtype=args["dtype"]) for m in args["methods"]}
turns = None
if args["set"] in MULTITURN_SETS:
    records = load_conversations(args["set"], args["limit"])
    turns = [len(r["turns"]) for r in records]
    answers = {m: [[] for _ in records] for m in args["methods"]}
else:
    prompts = load_prompt_set(args["set"], limit=args["limit"])
print(json.dumps({"ready": len(turns or prompts), "turns": turns}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    sot = engines[job["method"]]
    if turns is None:
        ids = sot.encode(prompts[job["prompt"]])
    else:
        ids = sot.encode(render(records[job["prompt"]], answers[job["method"]][job["prompt"]], True))
    params = sot.params(max_new_tokens=args["tokens"])
    c = sot.generate_ids([ids], params)[0]
    if turns is not None:
        answers[job["method"]][job["prompt"]].append(sot.tokenizer.decode(c.token_ids, skip_special_tokens=True))
    print(json.dumps({"ids": c.token_ids, "seconds": c.seconds, "tau": c.mean_accept_len,
                      "ttft": c.first_token_seconds}), flush=True)
"""


def start(root: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    spec = {"methods": args.methods.split(","), "set": args.set, "limit": args.limit, "tokens": args.tokens,
            "dtype": args.dtype, "model": args.model}
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
    ap.add_argument("--model", default="default", help="the target model, as `sot generate --model` takes it")
    args = ap.parse_args()
    procs, ready = {}, {}
    for k in "ab":  # one after the other: neither builds its kernels while the other times
        procs[k] = start(getattr(args, k), args)
        ready[k] = json.loads(procs[k].stdout.readline())
    n = min(r["ready"] for r in ready.values())
    turns = ready["a"]["turns"]  # (None: single prompts, one turn each)
    rows = []
    for method in args.methods.split(","):
        # per turn (0 for single prompts): tokens, seconds, taus, first-token times of each checkout
        tot: dict = {}
        identical: dict = {}
        for i in range(n):
            for t in range(turns[i] if turns else 1):
                order = ("a", "b") if (i + t) % 2 == 0 else ("b", "a")
                got = {k: ask(procs[k], {"method": method, "prompt": i}) for k in order}
                turn = t + 1 if turns else 0
                identical[turn] = identical.get(turn, 0) + (got["a"]["ids"] == got["b"]["ids"])
                for k in "ab":
                    acc = tot.setdefault((turn, k), [0, 0.0, [], [], 0.0])
                    acc[0] += len(got[k]["ids"])
                    acc[1] += got[k]["seconds"]
                    acc[2].append(got[k]["tau"])
                    acc[3].append(got[k]["ttft"])
                    acc[4] += got[k]["seconds"] - got[k]["ttft"]
        for turn in sorted(identical):
            speed = {k: tot[turn, k][0] / tot[turn, k][1] for k in "ab"}
            count = len(tot[turn, "a"][2])
            decode = {k: (tot[turn, k][0] - count) / max(tot[turn, k][4], 1e-9) for k in "ab"}
            tau = {k: sum(tot[turn, k][2]) / len(tot[turn, k][2]) for k in "ab"}
            ttft = {k: statistics.median(tot[turn, k][3]) for k in "ab"}
            rows.append(f"| {method}{f' turn {turn}' if turn else ''} | {identical[turn]}/{count} | "
                        f"{speed['a']:.1f} | {speed['b']:.1f} | {speed['b'] / speed['a']:.3f} | "
                        f"{decode['a']:.1f} | {decode['b']:.1f} | {decode['b'] / decode['a']:.3f} | "
                        f"{tau['a']:.2f} | {tau['b']:.2f} | {ttft['a']:.3f} | {ttft['b']:.3f} |")
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print("| method | identical | A tok/s | B tok/s | B/A | A decode tok/s | B decode tok/s | decode B/A | A tau | B tau "
          "| A first token s | B first token s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
