"""``sot bench`` argument parsing (the harness lives in :mod:`sot.bench.runner`)."""
from __future__ import annotations

import argparse
import sys

from sot.bench.runner import BenchConfig
from sot.cli.common import (
    DTYPE_CHOICES, add_chat_flag, add_device_arg, add_kv_cache_arg, add_policy_args, add_threads_arg, add_tree_args,
    apply_threads, non_negative_float, non_negative_int, policy_from_args, positive_int,
)
from sot.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from sot.sampling import SamplingMode


def add_bench_parser(sub: argparse._SubParsersAction) -> None:

    bench = sub.add_parser("bench", help="benchmark decoding methods side by side")
    bench.add_argument("--prompts", default="humaneval",
                       help="a JSONL file or a built-in set: sharegpt-heldout, humaneval, code-edit (refactors of "
                            "HumanEval's solutions), long, long-context (reviews of 1,000-3,000-token modules), "
                            "adversarial, mix (sharegpt-heldout and adversarial prompts, alternating); multi-turn: "
                            "sharegpt-multiturn, code-edit-multiturn, agent-loop")
    bench.add_argument("--multiturn", action="store_true",
                       help="run each record's 'turns' as a conversation: every turn is answered and appended before "
                            "the next is asked; the report gives each turn apart (multi-turn sets always do this)")
    bench.add_argument("--limit", type=positive_int, default=None, help="use the first N prompts")
    bench.add_argument("--prefix-cache-mb", type=non_negative_int, default=DEFAULT_PREFIX_CACHE_MB,
                       help="each engine method's prefix cache of prompt chunks already read, as sot generate and "
                            f"sot serve keep one; 0 turns it off (default {DEFAULT_PREFIX_CACHE_MB})")
    bench.add_argument("--methods", default="hf,plain,pld",
                       help="comma list of hf, hf-pld, plain, pld, suffix (suffix trees and prompt lookup), state, "
                            "auto (the default drafter: state with suffix trees), llamacpp; state=FILE adds the state "
                            "drafter with another predictor file (shown as state[FOLDER]), to compare predictors "
                            "side by side")
    bench.add_argument("--model", default="default")
    bench.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="engine dtype (auto: the faster of float32 and bfloat16 here; int8: 8-bit integer "
                            "products, see sot generate --help)")
    add_kv_cache_arg(bench)
    add_device_arg(bench)
    add_threads_arg(bench)
    bench.add_argument("--hf-dtype", choices=["bfloat16", "float32"], default="float32", help="dtype of the hf methods")
    bench.add_argument("--max-new-tokens", type=positive_int, default=BenchConfig.max_new_tokens)
    bench.add_argument("--temperature", type=non_negative_float, default=BenchConfig.temperature)
    bench.add_argument("--seed", type=int, default=BenchConfig.seed)
    bench.add_argument("--sampling", choices=[m.value for m in SamplingMode], default=BenchConfig.sampling,
                       help="engine sampling: coupled (default: seeded outputs equal plain decoding's, so speed "
                            "compares on the same tokens) or rejection")
    add_tree_args(bench)
    bench.add_argument("--predictor", default=None, help="state predictor file (default: the shipped one)")
    bench.add_argument("--batch-size", type=positive_int, default=1,
                       help="engine methods decode this many prompts together, as a continuous batch over all "
                            "the prompts; the methods' engines take turns a step at a time, each timed on its own steps "
                            "(hf and llamacpp stay at 1)")
    bench.add_argument("--prompt-budget", type=non_negative_int, default=BenchConfig.prompt_budget,
                       help="with --batch-size above 1 or --sweep batch-size: prompt tokens a step reads at most, "
                            "as sot serve reads prompts, so that the engines' turns stay short (0: whole prompts "
                            "in one step; default %(default)s)")
    bench.add_argument("--full-vocab", action="store_true",
                       help="state: propose from the whole vocabulary, not the predictor's draft vocabulary")
    bench.add_argument("--no-lookup", dest="lookup", action="store_false",
                       help="state: do not merge prompt-lookup paths into the predictor's trees")
    add_policy_args(bench)
    bench.add_argument("--ignore-eos", action="store_true")
    bench.add_argument("--sweep", default=None,
                       help="NAME=v1,v2,... with NAME max-depth, max-nodes (or budget), predictor-nodes, "
                            "predictor-depth, "
                            "draft-top-k, warmup, "
                            "batch-size, policy (e.g. policy=heuristic,learned,rl: each policy runs as a method of "
                            "its own, alternating with the others on every prompt), or dtype (e.g. dtype=float32,int8: "
                            "every engine method in each mode, each compared with its own mode's plain decoding)")
    bench.add_argument("--out", default="bench-out", help="output folder")
    add_chat_flag(bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses

    from sot.bench.report import summary
    from sot.bench.runner import BenchConfig, check_bench, dtype_drafter, parse_sweep, per_method_auto, run_bench
    from sot.dtype_choice import resolve
    from sot.models.loading import resolve_device

    device = resolve_device(args.device)
    apply_threads(args)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    drafter, predictor = dtype_drafter(methods, args.predictor)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    cfg = BenchConfig(
        prompts=args.prompts,
        limit=args.limit,
        methods=methods,
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=str(device),
        hf_dtype=args.hf_dtype,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        sampling=args.sampling,
        max_nodes=args.max_nodes,
        max_depth=args.max_depth,
        predictor_nodes=args.predictor_nodes,
        predictor_depth=args.predictor_depth,
        predictor=args.predictor,
        draft_top_k=args.draft_top_k,
        batch_size=args.batch_size,
        policy=policy_from_args(args),
        full_vocab=args.full_vocab,
        lookup=args.lookup,
        chat=args.chat,
        ignore_eos=args.ignore_eos,
        sweep=sweep,
        multiturn=args.multiturn,
        prefix_cache_mb=args.prefix_cache_mb,
        prompt_budget=args.prompt_budget,
        out=args.out,
    )
    check_bench(cfg)  # before --dtype auto times anything or a model loads
    # the report names the dtype that ran: auto picks each method's own where it can (the runner
    # resolves it per method), else one mode, timed for the first speculative method (with
    # --sweep dtype, the swept modes run and --dtype is not read)
    if not per_method_auto(cfg):
        cfg = dataclasses.replace(cfg, dtype=(" and ".join(sweep[1]) if sweep and sweep[0] == "dtype"
                                              else resolve(args.dtype, args.model, drafter, predictor,
                                                           device=str(device)).dtype))
    result = run_bench(cfg)
    print(summary(result))
    print(f"results in {cfg.out}/ (results.json, report.md, per-method JSONL, plots)", file=sys.stderr)
    return 0

