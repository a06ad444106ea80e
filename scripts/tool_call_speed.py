"""Tool calls with and without speculation: the default model offered two tools, each
``tool_choice`` mode, the default drafter against ``none`` in one process, alternating
rounds, greedy. Each round starts with empty suffix stores and prefix caches, so the answers
of one round do not draft the next's (those of earlier prompts in a round do, as in a
server). Prints tokens/s, tau and whether the answers are identical.

    python scripts/tool_call_speed.py [--rounds 3] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import statistics
import time

from sot import SoT

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Is it raining in London?",
           "Tell me the temperature in Cairo in fahrenheit.", "What's the time in New York right now?",
           "How warm is it in Sydney?"]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def forget(sot: SoT) -> None:
    """Empty the engine's store of earlier answers and its prefix cache."""
    if sot.engine.drafter.suffix_stores is not None:
        sot.engine.drafter.suffix_stores.clear()
    if sot.engine.prefix_cache is not None:
        sot.engine.prefix_cache.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    engines = {"auto": SoT.load(dtype="float32"), "none": SoT.load(dtype="float32", drafter="none")}
    for label, choice in CHOICES.items():
        ask = dict(max_new_tokens=args.max_new_tokens, tools=[WEATHER, CLOCK], tool_choice=choice)
        for sot in engines.values():  # warm-up, untimed
            sot.generate(PROMPTS[:1], **ask)
        speed = {name: [] for name in engines}
        tau, outputs, calls = {}, {}, {}
        for _ in range(args.rounds):
            for name, sot in engines.items():
                forget(sot)
                start = time.perf_counter()
                out = sot.generate(PROMPTS, **ask)
                seconds = time.perf_counter() - start
                speed[name].append(sum(o.new_tokens for o in out) / seconds)
                tau[name] = sum(sum(o.accept_lengths) for o in out) / sum(o.steps for o in out)
                outputs[name] = [o.token_ids for o in out]
                calls[name] = sum(len(o.tool_calls) for o in out)
        med = {name: statistics.median(v) for name, v in speed.items()}
        print(f"tool_choice {label}: auto {med['auto']:.1f} tok/s (tau {tau['auto']:.2f}), "
              f"none {med['none']:.1f} tok/s: {med['auto'] / med['none']:.2f}x; "
              f"identical {outputs['auto'] == outputs['none']}; calls {calls['auto']} in {len(PROMPTS)} answers")


if __name__ == "__main__":
    main()
