"""``sot train``: ``gen-data`` (self-distillation), ``code-prompts`` (coding prompts for it),
``prepare`` (target-state cache), ``fit``, ``onpolicy`` (fit on recorded verify passes) and
``policy`` (a commit policy)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from sot.cli.common import (
    FLOAT_DTYPE_CHOICES, add_device_arg, non_negative_float, non_negative_int, positive_float, positive_int,
)
from sot.drafters.state.config import ARCHES, default_state_layers
from sot.online.loss import OnlineLossConfig
from sot.train.acceptance import PolicyTrainConfig
from sot.train.onpolicy import OnPolicyConfig
from sot.train.trainer import TrainConfig


def parse_layers(text: str | None, num_layers: int) -> tuple[int, ...]:
    from sot.errors import ConfigError

    if not text:
        return default_state_layers(num_layers)
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--layers takes comma-separated integers, got {text!r}") from None
    if any(not 0 <= x <= num_layers for x in layers):
        raise ConfigError(f"--layers must lie in 0..{num_layers} for this model, got {text!r}")
    if list(layers) != sorted(set(layers)):  # (a predictor reads each layer once, in order)
        raise ConfigError(f"--layers must be distinct and ascending, got {text!r}")
    return layers


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a state predictor (gen-data, code-prompts, prepare, fit, "
                                          "onpolicy) or a commit policy (policy)")
    tsub = train.add_subparsers(dest="train_command", required=True, parser_class=type(train), metavar="STAGE",
                                 title="stages")

    gen = tsub.add_parser("gen-data", help="regenerate ShareGPT answers with the target (self-distillation)")
    gen.add_argument("--model", default="default")
    gen.add_argument("--out", required=True, help="JSONL file to write (appends; resumes by id)")
    gen.add_argument("--limit", type=positive_int, default=1000,
                     help="conversations the --out file should hold when done (a run picks up where an "
                          "earlier one stopped)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=256)
    gen.add_argument("--batch-size", type=positive_int, default=8)
    gen.add_argument("--temperature", type=non_negative_float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-prompt-tokens", type=positive_int, default=512, help="skip longer first turns")
    gen.add_argument("--match", default=None, metavar="REGEX",
                     help="only first turns this regular expression finds (case-insensitive), e.g. coding prompts")
    gen.add_argument("--prompts", default=None, metavar="FILE",
                     help="JSONL of prompts to answer instead of ShareGPT: records with 'id' and 'prompt' "
                          "(e.g. from 'sot train code-prompts') or ShareGPT 'conversations'")
    gen.add_argument("--drafter", choices=["auto", "none", "pld", "state"], default="auto",
                     help="drafter for generation (output is the same with any; auto: the state predictor if shipped)")

    code = tsub.add_parser("code-prompts", help="write function-completion prompts built from Python sources "
                                                "(default: the standard library)")
    code.add_argument("--out", required=True, help="JSONL file to write (input of 'gen-data --prompts')")
    code.add_argument("--limit", type=positive_int, default=1000, help="prompts to write (a seeded random sample)")
    code.add_argument("--seed", type=int, default=0)
    code.add_argument("--source", default=None, metavar="DIR",
                      help="folder of Python sources, e.g. a site-packages folder (default: the standard library)")
    code.add_argument("--per-package", type=positive_int, default=None, metavar="N",
                      help="at most N prompts from one top-level package (default: no cap)")

    prep = tsub.add_parser("prepare", help="run the target over training data and cache its states (bf16)")
    prep.add_argument("--model", default="default", help="the target model whose states are cached (default: "
                      "%(default)s)")
    prep.add_argument("--out", required=True, help="folder for the state cache")
    prep.add_argument("--data", default=None, help="JSONL from gen-data (default: packaged ShareGPT)")
    prep.add_argument("--tokens", type=positive_int, default=1_000_000, help="training tokens to cache")
    prep.add_argument("--eval-conversations", type=positive_int, default=48,
                      help="conversations cached for held-out evaluation (the first of --eval-data)")
    prep.add_argument("--eval-data", default=None,
                      help="JSONL of held-out conversations, e.g. gen-data answers to prompts kept out of "
                           "--data (default: the sharegpt-heldout split, whatever --data is)")
    prep.add_argument("--seq-len", type=positive_int, default=1024,
                      help="tokens of each conversation cached, at most (default %(default)s; cut to the model's "
                           "context)")
    prep.add_argument("--layers", default=None, help="hidden-state layers, e.g. 2,15,27 (default: 2, L/2, L-3)")
    prep.add_argument("--dtype", choices=FLOAT_DTYPE_CHOICES, default="auto",
                      help="dtype the target runs in (auto: bfloat16 where the hardware computes it natively, "
                           "else float32); the cache stores bf16 either way")
    add_device_arg(prep)

    fit = tsub.add_parser("fit", help="train a state predictor on a prepared state cache")
    fit.add_argument("--model", default=TrainConfig.model,
                     help="the target model the cache was prepared with (default: %(default)s)")
    fit.add_argument("--data", required=True,
                     help="state cache folder from 'sot train prepare', or several, comma-separated, to train on all "
                          "(held-out evaluation uses the first)")
    fit.add_argument("--out", required=True, help="run folder: checkpoints, predictor, loss.png, accept.png")
    fit.add_argument("--steps", type=positive_int, default=TrainConfig.steps,
                     help="optimizer steps the schedule spans (default %(default)s)")
    fit.add_argument("--tokens-per-step", type=positive_int, default=TrainConfig.tokens_per_step,
                     help="tokens a step trains on, of whole cached sequences: prompts and answers "
                          "(default %(default)s)")
    fit.add_argument("--lr", type=positive_float, default=TrainConfig.lr,
                     help="peak learning rate of the warmup-cosine schedule (default %(default)s)")
    fit.add_argument("--warmup", type=non_negative_int, default=TrainConfig.warmup,
                     help="learning-rate warm-up steps (0: none)")
    fit.add_argument("--unroll", type=positive_int, default=TrainConfig.unroll, help="training-time-test steps")
    fit.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab,
                     help="reduced draft vocabulary (0 = full)")
    fit.add_argument("--init", choices=["target", "random"], default=TrainConfig.init,
                     help="start the layer from the target's last layer (target) or from scratch (random)")
    fit.add_argument("--init-from", default=TrainConfig.init_from,
                     help="start from this predictor file (e.g. to continue training)")
    fit.add_argument("--arch", choices=ARCHES, default=TrainConfig.arch,
                     help="predictor architecture: SoT's own (native) or EAGLE-3's draft layer (eagle3), which "
                          "'sot export --format eagle3' writes for vLLM and SGLang")
    fit.add_argument("--decoder-layers", type=positive_int, default=TrainConfig.decoder_layers,
                     help="decoder layers in the predictor (default 1); with --init-from, layers beyond the "
                          "file's start as the identity, so training continues from what the file predicts")
    fit.add_argument("--added-lr-scale", type=positive_float, default=TrainConfig.added_lr_scale,
                     help="learning rate of the layers added to an --init-from file, as a multiple of --lr "
                          "(their outputs start at zero)")
    fit.add_argument("--recount-vocab", action="store_true",
                     help="with --init-from: count the draft vocabulary (--draft-vocab tokens) anew on --data "
                          "instead of keeping the file's")
    fit.add_argument("--eval-every", type=positive_int, default=TrainConfig.eval_every,
                     help="steps between held-out evaluations (default %(default)s)")
    fit.add_argument("--save-every", type=positive_int, default=TrainConfig.save_every,
                     help="steps between checkpoints (default %(default)s; SIGTERM and Ctrl-C save too)")
    fit.add_argument("--seed", type=int, default=TrainConfig.seed,
                     help="the seed of the data order, the noise and a new predictor's weights (default "
                          "%(default)s)")
    fit.add_argument("--max-seconds", type=non_negative_float, default=TrainConfig.max_seconds,
                     help="stop (with a checkpoint) after this many seconds of training (0: no limit)")
    fit.add_argument("--stop-after", type=int, default=TrainConfig.stop_after, metavar="STEP",
                     help="stop (with a checkpoint) after this step; the learning-rate schedule is still "
                          "planned over --steps (0: run all --steps)")
    fit.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=TrainConfig.precision,
                     help="compute precision (auto: bf16 autocast where the hardware computes bf16 natively, "
                          "else float32; master weights and losses are float32 either way)")

    op = tsub.add_parser("onpolicy", help="train the state predictor on its own drafts: decode, record what the "
                         "verify passes computed, train where the drafts went wrong; repeat")
    op.add_argument("--model", default=OnPolicyConfig.model, help="target model that decodes the prompts")
    op.add_argument("--init-from", default=OnPolicyConfig.init_from,
                    help="predictor file to start from (default: the one shipped for the default model)")
    op.add_argument("--out", required=True, help="run folder: buffer/ shards, checkpoint, predictor, report.json")
    op.add_argument("--iterations", type=positive_int, default=OnPolicyConfig.iterations,
                    help="rounds of decode, record, train")
    op.add_argument("--prompts-per-iteration", type=positive_int, default=OnPolicyConfig.prompts_per_iteration,
                    help="prompts decoded and recorded in each round")
    op.add_argument("--code-share", type=float, default=OnPolicyConfig.code_share,
                    help="share of coding requests among the prompts (the rest: ShareGPT training prompts)")
    op.add_argument("--prompts", default=OnPolicyConfig.prompts_file, metavar="FILE",
                    help="JSONL of prompts to decode instead ('id' and 'prompt', or ShareGPT 'conversations')")
    op.add_argument("--batch-size", type=positive_int, default=OnPolicyConfig.batch_size,
                    help="prompts decoded together")
    op.add_argument("--max-new-tokens", type=positive_int, default=OnPolicyConfig.max_new_tokens,
                    help="answer tokens per prompt at most")
    op.add_argument("--temperatures", default=",".join(f"{t:g}" for t in OnPolicyConfig.temperatures),
                    help="comma list; decode batches take them in turn (0: greedy)")
    op.add_argument("--steps-per-iteration", type=int, default=OnPolicyConfig.steps_per_iteration,
                    help="training steps on the buffer after each round's decoding (0: record only)")
    op.add_argument("--tokens-per-step", type=positive_int, default=OnPolicyConfig.tokens_per_step,
                    help="tokens of recorded sequences a training step reads")
    op.add_argument("--lr", type=positive_float, default=OnPolicyConfig.lr,
                    help="peak learning rate of the warmup-cosine schedule over all the steps")
    op.add_argument("--unroll", type=positive_int, default=OnlineLossConfig.unroll,
                    help="steps the predictor is rolled forward on its own states in the loss")
    op.add_argument("--uniform", type=float, default=OnlineLossConfig.uniform,
                    help="weight of every answer row beside the rows the recorded chains visited (fit: 1 and no "
                         "chains)")
    op.add_argument("--error-weight", type=float, default=OnlineLossConfig.error_weight,
                    help="extra weight of the row where a recorded chain was first rejected")
    op.add_argument("--buffer-gb", type=positive_float, default=OnPolicyConfig.buffer_gb,
                    help="recorded data kept; the oldest shards go beyond it")
    op.add_argument("--max-seconds", type=non_negative_float, default=OnPolicyConfig.max_seconds,
                    help="stop (with a checkpoint) after this many seconds of decoding and training (0: no "
                         "limit)")
    op.add_argument("--dtype", choices=FLOAT_DTYPE_CHOICES, default=OnPolicyConfig.dtype,
                    help="the decoding target's dtype (the predictor trains in float32)")
    op.add_argument("--seed", type=int, default=OnPolicyConfig.seed,
                    help="seeds the batches drawn, the loss's noise and the sampled answers")

    pol = tsub.add_parser("policy", help="train a commit policy from logged decoding traces: the acceptance "
                          "model of --policy learned, or the network of --policy rl (--kind rl)")
    pol.add_argument("--kind", choices=["learned", "rl"], default=PolicyTrainConfig.kind,
                     help="learned: fit the acceptance model; rl: train the rl policy on simulated speed")
    pol.add_argument("--model", default=PolicyTrainConfig.model)
    pol.add_argument("--predictor", default=PolicyTrainConfig.predictor,
                     help="state predictor file (default: the shipped one)")
    pol.add_argument("--out", required=True,
                     help="run folder: traces.pt (reused if present), policy.safetensors or rl-policy.safetensors, "
                          "report")
    pol.add_argument("--prompts", type=positive_int, default=PolicyTrainConfig.prompts,
                     help="ShareGPT training prompts to decode")
    pol.add_argument("--code-prompts", type=int, default=PolicyTrainConfig.code_prompts,
                     help="coding requests (from the standard library's functions) to decode too")
    pol.add_argument("--max-new-tokens", type=positive_int, default=PolicyTrainConfig.max_new_tokens)
    pol.add_argument("--temperatures", default=",".join(f"{t:g}" for t in PolicyTrainConfig.temperatures),
                     help="comma list of sampling temperatures to decode at (coupled sampling)")
    pol.add_argument("--batch-sizes", default=",".join(str(b) for b in PolicyTrainConfig.batch_sizes),
                     help="comma list of batch sizes; they take turns over the prompts")
    pol.add_argument("--dtype", choices=FLOAT_DTYPE_CHOICES, default=PolicyTrainConfig.dtype)
    pol.add_argument("--epochs", type=positive_int, default=PolicyTrainConfig.epochs,
                     help="epochs of the acceptance model's fit (--kind learned)")
    pol.add_argument("--rl-epochs", type=positive_int, default=PolicyTrainConfig.rl_epochs,
                     help="simulator replays of the training batches (--kind rl)")
    pol.add_argument("--seed", type=int, default=PolicyTrainConfig.seed)


def cmd_code_prompts(args: argparse.Namespace) -> int:
    from sot.train.code_prompts import write_code_prompts

    n = write_code_prompts(args.out, limit=args.limit, seed=args.seed, root=args.source,
                           per_package=args.per_package)
    print(f"wrote {n} function-completion prompts to {args.out}", file=sys.stderr)
    return 0


def cmd_gen_data(args: argparse.Namespace) -> int:
    from sot.cli.common import check_distinct_files
    from sot.train.selfdistill import generate_answers

    check_distinct_files(args)  # (--out over the --prompts file would count the prompts as done)
    n = generate_answers(args.model, args.out, limit=args.limit, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, temperature=args.temperature, seed=args.seed,
                         drafter=args.drafter, max_prompt_tokens=args.max_prompt_tokens,
                         match=args.match, prompts=args.prompts)
    print(f"{args.out} holds {n} regenerated conversations", file=sys.stderr)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from sot.models.loading import dtype_name, load_model, resolve_device, resolve_dtype
    from sot.models.support import text_config
    from sot.train.data import build_state_cache, evaluation_conversations, training_conversations

    from sot.errors import ConfigError

    device = resolve_device(args.device)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; give the state cache's folder")
    convs = training_conversations(args.data)
    held_out = evaluation_conversations(args.eval_data, args.eval_conversations, convs)  # checked before loading
    for found, source, what in ((convs, args.data, "training"), (held_out, args.eval_data, "held-out")):
        if not found:  # (before the model loads, not after the other cache is built)
            from sot.errors import ConfigError

            raise ConfigError(f"{source or 'the packaged ShareGPT set'} holds no conversation for the {what} "
                              "cache" + (" outside the held-out split" if what == "training" else ""))
    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device)
    layers = parse_layers(args.layers, text_config(loaded.model.config).num_hidden_layers)
    out = Path(args.out)
    config = text_config(loaded.model.config)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_len = args.seq_len
    if context and seq_len > context:
        print(f"--seq-len {seq_len} is past this model's context of {context} tokens: conversations are cut "
              f"at {context}", file=sys.stderr)
        seq_len = context
    # (the held-out cache first: it is small, and data that leaves it empty stops the run before
    # the training cache's hours, not after)
    ev = build_state_cache(loaded.model, loaded.tokenizer, held_out, out / "eval", layers, None, seq_len)
    meta = build_state_cache(loaded.model, loaded.tokenizer, convs, out / "train", layers, args.tokens, seq_len)
    info = {"model": args.model, "data": args.data or "sharegpt", "eval_data": args.eval_data or "sharegpt-heldout",
            "dtype": dtype_name(loaded.model.dtype), "train": meta, "eval": ev}
    (out / "prepare.json").write_text(json.dumps(info, indent=2))
    if args.tokens and meta["tokens"] < args.tokens:
        print(f"the data ran out at {meta['tokens']:,} of the {args.tokens:,} tokens asked for (--tokens)",
              file=sys.stderr)
    print(f"cached {meta['tokens']:,} training tokens ({meta['bytes'] / 2**30:.2f} GiB) and "
          f"{ev['tokens']:,} held-out tokens ({ev['bytes'] / 2**20:.0f} MiB) in {out}", file=sys.stderr)
    return 0


def _keeps_its_start(args: argparse.Namespace) -> None:
    """Stop when ``--init-from`` is the predictor file that ``--out``'s run writes: training
    would replace the predictor it starts from."""
    from sot.cli.common import same_file
    from sot.errors import ConfigError

    written = str(Path(args.out) / "predictor.safetensors")
    if args.init_from and same_file(args.init_from, written):
        raise ConfigError(f"--init-from {args.init_from} is the file this run writes (--out {args.out}); "
                          "training would replace the predictor it starts from: give --out another folder")


def cmd_fit(args: argparse.Namespace) -> int:
    from sot.train.trainer import TrainConfig, fit

    _keeps_its_start(args)
    cfg = TrainConfig(
        model=args.model, data=args.data, out=args.out, steps=args.steps, tokens_per_step=args.tokens_per_step,
        lr=args.lr, warmup=args.warmup, unroll=args.unroll, draft_vocab=args.draft_vocab, init=args.init,
        init_from=args.init_from, arch=args.arch, decoder_layers=args.decoder_layers,
        added_lr_scale=args.added_lr_scale, recount_vocab=args.recount_vocab, eval_every=args.eval_every,
        save_every=args.save_every, seed=args.seed, max_seconds=args.max_seconds, stop_after=args.stop_after,
        precision=args.precision,
    )
    path = fit(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"predictor: {path} (use it with sot generate --predictor {path})", file=sys.stderr)
    return 0


def _numbers(text: str, flag: str, kind=float) -> tuple:
    from sot.errors import ConfigError

    try:
        values = tuple(kind(t) for t in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{flag} takes finite numbers, got {text!r}")
    return values


def cmd_policy(args: argparse.Namespace) -> int:
    from sot.errors import ConfigError
    from sot.train.acceptance import PolicyTrainConfig, train_policy

    temps = _numbers(args.temperatures, "--temperatures")
    if any(t < 0 for t in temps):
        raise ConfigError("temperatures must be >= 0")
    sizes = _numbers(args.batch_sizes, "--batch-sizes", int)
    if any(b < 1 for b in sizes):
        raise ConfigError("batch sizes must be >= 1")
    if args.code_prompts < 0:
        raise ConfigError("--code-prompts must be >= 0")
    cfg = PolicyTrainConfig(model=args.model, predictor=args.predictor, out=args.out, kind=args.kind,
                            prompts=args.prompts, code_prompts=args.code_prompts,
                            max_new_tokens=args.max_new_tokens, temperatures=temps, batch_sizes=sizes,
                            dtype=args.dtype, epochs=args.epochs, rl_epochs=args.rl_epochs, seed=args.seed)
    if args.kind == "rl":
        from sot.train.rl import train_rl_policy

        path = train_rl_policy(cfg)
        report = json.loads((Path(args.out) / "rl-report.json").read_text())
        row = report["held_out"][0]
        others = ", ".join(f"{k} {row[k]['speedup']:.3f}x" for k in ("heuristic", "learned") if k in row)
        print(f"{report['train_batches']} training batches; held-out simulated speed-up over plain: "
              f"rl {row['rl']['speedup']:.3f}x, {others}; wrote {path}", file=sys.stderr)
        return 0
    path = train_policy(cfg)
    report = json.loads((Path(args.out) / "report.json").read_text())
    ll = report["val_log_loss"]
    print(f"{report['nodes']:,} logged nodes (acceptance {report['accept_rate']:.2f}); held-out log-loss: "
          f"learned {ll['learned']:.3f}, heuristic {ll['heuristic']:.3f}; wrote {path}", file=sys.stderr)
    return 0


def cmd_onpolicy(args: argparse.Namespace) -> int:
    from sot.errors import ConfigError
    from sot.train.onpolicy import train_onpolicy

    if args.uniform < 0 or args.error_weight < 0:
        raise ConfigError("--uniform and --error-weight must be >= 0")
    _keeps_its_start(args)
    loss = OnlineLossConfig(unroll=args.unroll, uniform=args.uniform, error_weight=args.error_weight)
    cfg = OnPolicyConfig(model=args.model, init_from=args.init_from, out=args.out, iterations=args.iterations,
                         prompts_per_iteration=args.prompts_per_iteration, code_share=args.code_share,
                         prompts_file=args.prompts or "",
                         batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                         temperatures=_numbers(args.temperatures, "--temperatures"),
                         steps_per_iteration=args.steps_per_iteration, tokens_per_step=args.tokens_per_step,
                         lr=args.lr, buffer_gb=args.buffer_gb, max_seconds=args.max_seconds, dtype=args.dtype,
                         seed=args.seed, loss=loss)
    path = train_onpolicy(cfg)
    report = json.loads((Path(args.out) / "report.json").read_text())
    print(f"{report['steps']} steps on {report['buffer_sequences']} recorded sequences "
          f"({report['buffer_tokens']:,} tokens); decoding {report['decode_seconds']:.0f}s, training "
          f"{report['train_seconds']:.0f}s; wrote {path}", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    return {"gen-data": cmd_gen_data, "code-prompts": cmd_code_prompts, "prepare": cmd_prepare, "fit": cmd_fit,
            "onpolicy": cmd_onpolicy, "policy": cmd_policy}[args.train_command](args)
