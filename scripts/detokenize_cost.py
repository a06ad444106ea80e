"""Time the text bookkeeping of one long answer: the engine's stop-string check and the
server's stream text and log-probability offsets, for 4,000 tokens of the default tokenizer
committed 2 at a time (best of 3). Run it on two checkouts to compare them."""
from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoTokenizer

from sot.models.loading import convert_gguf, default_gguf_path
from sot.requests import GenerationParams, LiveRequest, SequenceResult
from sot.sampling import TokenLogprob
from sot.server.protocol import LogprobWriter, TextAssembler

TOKENS, STEP = 4000, 2


def best_of(fn, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    tok = AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tok.encode(readme * 4)[:TOKENS]

    def decode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True)

    def engine() -> None:
        params = GenerationParams(max_new_tokens=TOKENS + 1, stop=("<<never>>",))
        seq = LiveRequest(0, [1], params, SequenceResult(index=0, token_ids=[]), None, 0.0)
        for i in range(0, len(ids), STEP):
            seq.commit(ids[i : i + STEP], 0.0, decode, counts_as_step=True)

    def stream() -> None:
        text = TextAssembler(tok, ("<<never>>",))
        for i in range(0, len(ids), STEP):
            text.add(ids[i : i + STEP], final=False)

    def logprobs() -> None:
        lp = LogprobWriter(tok, chat=False)
        text = TextAssembler(tok, ())
        for i in range(0, len(ids), STEP):
            lp.add([TokenLogprob(t, -1.0, ()) for t in ids[i : i + STEP]])
            text.add(ids[i : i + STEP], final=False)
            lp.upto(text.sent)

    print(f"{len(ids)} tokens, {STEP} per step")
    for name, fn in (("engine stop-string check", engine), ("server stream text", stream),
                     ("server stream text + logprobs", logprobs)):
        print(f"  {name:32s} {best_of(fn) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
