"""How far copying could carry a multi-turn bench run: the copy oracle's tau per turn.

At each step the oracle drafts the longest run of the answer's next tokens (at most --depth)
that occurs anywhere in its source, and the step commits that run plus one token: the tau of
a copy drafter that always knows where to copy from (hindsight, so no drafter that copies
does better at that depth). Two sources are compared: the turn's own context (the prompt and
the answer so far: what prompt lookup and the per-request suffix tree see) and that context
plus every earlier prompt and answer of the run (what the global suffix store adds). The
answers are a method's from a ``sot bench`` output folder; each conversation's later turns
are rendered from them, as the bench rendered them.

    python scripts/copy_oracle.py docs/bench/avx512-bf16/suffix/agent-loop --set agent-loop
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def as_text(ids: list[int]) -> str:
    """Token ids as one character each, so that substring search is token-exact."""
    return "".join(chr(0x100 + i) for i in ids)


def oracle_steps(answer: str, context: str, store: str, depth: int) -> int:
    """Steps the copy oracle takes over ``answer`` (texts from :func:`as_text`)."""
    i = steps = 0
    while i < len(answer):
        source = store + "\x00" + context + answer[:i]
        lo, hi = 0, min(depth, len(answer) - i)
        while lo < hi:  # (a run that occurs has every prefix occurring: binary search)
            mid = (lo + hi + 1) // 2
            if answer[i:i + mid] in source:
                lo = mid
            else:
                hi = mid - 1
        i += lo + 1
        steps += 1
    return steps


def main() -> int:
    from sot.api import SoT
    from sot.bench.conversations import load_conversations, render

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a sot bench --out folder of a multi-turn set")
    ap.add_argument("--set", required=True, help="the multi-turn set the folder ran")
    ap.add_argument("--method", default="plain", help="whose answers (the folder's METHOD.jsonl)")
    ap.add_argument("--depth", type=int, default=24)
    args = ap.parse_args()
    sot = SoT.load(drafter="none", dtype="float32")  # (only its tokenizer and chat template)
    answers: dict[str, dict[int, list[int]]] = {}
    for line in open(Path(args.folder) / f"{args.method}.jsonl"):
        rec = json.loads(line)
        conv, turn = rec["question_id"].rsplit("#", 1)
        answers.setdefault(conv, {})[int(turn)] = rec["choices"][0]["turns"][0]
    store, totals = "", {}
    for c, record in enumerate(load_conversations(args.set, None)):
        given = answers.get(str(record.get("id", c)))
        if not given:
            continue
        texts: list[str] = []
        for t in range(len(record["turns"])):
            if t + 1 not in given:
                break
            ids = given[t + 1]
            context = as_text(sot.encode(render(record, texts, True)))
            answer = as_text(ids)
            for name, extra in (("context", ""), ("store", store)):
                acc = totals.setdefault((t + 1, name), [0, 0])
                acc[0] += len(answer)
                acc[1] += oracle_steps(answer, context, extra, args.depth)
            store += "\x00" + context + answer
            texts.append(sot.tokenizer.decode(ids, skip_special_tokens=True))
    print(f"| turn | copy oracle tau, context (depth {args.depth}) | context + earlier turns and requests |")
    print("|---|---|---|")
    for t in sorted({t for t, _ in totals}):
        ctx, both = totals[t, "context"], totals[t, "store"]
        print(f"| {t} | {ctx[0] / ctx[1]:.2f} | {both[0] / both[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
