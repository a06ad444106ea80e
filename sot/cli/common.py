"""What every ``sot`` subcommand shares: argument validators, the argument groups (whose
defaults come from the config dataclasses), the one-line-error parser, and model loading."""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sot.drafters.base import DRAFT_TOP_K, DrafterKind, TreeBudget
from sot.errors import SoTError
from sot.online.defaults import ADAPT_BUDGET
from sot.policy.config import PolicyConfig, PolicyKind
from sot.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from sot.requests import MAX_LOGIT_BIAS, MAX_PENALTY, GenerationParams
from sot.sampling import MAX_TOP_LOGPROBS, SamplingMode, SamplingParams

if TYPE_CHECKING:
    from sot.api import SoT
    from sot.online.adapt import AdaptConfig


def _checked(cast: type, name: str, ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: parse with ``cast`` and require ``ok(value)``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _checked(int, "an integer", lambda v: v >= 1, ">= 1")
non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")
non_negative_float = _checked(float, "a number", lambda v: 0 <= v < float("inf"), ">= 0 and finite")
probability = _checked(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")
unit_interval = _checked(float, "a number", lambda v: 0 <= v <= 1, "in [0, 1]")
positive_float = _checked(float, "a number", lambda v: 0 < v < float("inf"), "> 0 and finite")
#: a rate in events a second; ``inf``, as vLLM's benchmarks spell it, sends everything at once
positive_rate = _checked(float, "a number", lambda v: v > 0, "> 0 (inf: all at once)")
top_logprobs = _checked(int, "an integer", lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"0 to {MAX_TOP_LOGPROBS}")
penalty = _checked(float, "a number", lambda v: abs(v) <= MAX_PENALTY, f"-{MAX_PENALTY:g} to {MAX_PENALTY:g}")


#: values of --dtype (sot.models.loading.resolve_dtype interprets them; kept here so that
#: parsing arguments does not import torch; a test checks that the two lists agree)
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "int8")
#: the float modes only: where the target's states are recorded for training or weights written
FLOAT_DTYPE_CHOICES = tuple(d for d in DTYPE_CHOICES if d != "int8")


#: ``--drafter`` choices; ``auto`` is resolved by :meth:`sot.api.SoT.load`
DRAFTER_CHOICES = ("auto", "none", "pld", "suffix", "state")


def add_drafter_args(p: argparse.ArgumentParser, store: bool = True) -> None:
    """``--drafter`` and, with ``store``, ``--suffix-store``."""
    p.add_argument("--drafter", choices=DRAFTER_CHOICES, default="auto",
                   help="auto: the state predictor with suffix trees and prompt lookup when a predictor fits the "
                        "model, else suffix trees and prompt lookup; state: the predictor with prompt lookup")
    if store:
        p.add_argument("--suffix-store", metavar="FILE",
                       help="earlier answers to draft from (auto and suffix drafters): read at start if the file "
                            "exists, written back at the end, so later runs draft from this one's answers")


#: ``--device`` by default (sot.models.loading.resolve_device interprets it; a test checks
#: that this equals sot.models.loading.DEFAULT_DEVICE)
DEFAULT_DEVICE = "auto"


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=DEFAULT_DEVICE, metavar="DEVICE",
                   help="where the model runs: auto (default: a CUDA GPU when one is visible, else the CPU), cpu, "
                        "cuda or cuda:N")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads of the model's passes (default: PyTorch's, one a core); where other work "
                        "shares the machine, give the cores left free: each pass waits for its slowest thread")


def apply_threads(args: argparse.Namespace) -> None:
    """``--threads``, set for every pass of this process (and the --dtype auto timings, which
    are kept per thread count)."""
    if getattr(args, "threads", None) is not None:
        from sot.machine import set_threads

        set_threads(args.threads, "--threads")


def add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``."""
    from sot.models.loading import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="KV cache dtype (default auto: the engine's, float32 or bfloat16); with --dtype float32 or "
                        "int8, float16 or bfloat16 halves the bytes attention reads (faster at long contexts) and "
                        "rounds the keys and values it stores, so answers may differ slightly from float32's; "
                        "speculation stays exact. SoT's CPU attention only")


def add_model_args(p: argparse.ArgumentParser, drafting: bool = True) -> None:
    """The model's flags; with ``drafting``, also the draft tree's, the predictor's and the
    commit policy's (a command that drafts nothing, like ``score``, leaves them out of its help
    and takes their defaults)."""
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a model folder or a .gguf file")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="engine dtype (default auto: the faster of float32 and bfloat16 here, timed once per "
                        "machine, model, drafter and --threads and kept under ~/.cache/sot); int8: products in 8-bit "
                        "integers over a GGUF model's blocks (other weights rounded to 8-bit blocks), as llama.cpp "
                        "computes them (faster on CPUs; answers differ slightly from float32's, and speculation stays "
                        "exact)")
    add_kv_cache_arg(p)
    add_device_arg(p)
    add_threads_arg(p)
    p.add_argument("-v", "--verbose", action="store_true", help="print how --dtype was chosen, with the timings")
    if drafting:
        add_tree_args(p)
        p.add_argument("--predictor", default=None,
                       help="state predictor: a SoT predictor file, or an EAGLE-3 head folder (config.json and "
                            "model.safetensors, as vLLM and SGLang load them); default: the one shipped for the "
                            "default model")
        add_policy_args(p)
    else:
        defaults = argparse.ArgumentParser()
        add_tree_args(defaults)
        add_policy_args(defaults)
        p.set_defaults(predictor=None, **vars(defaults.parse_args([])))
    p.add_argument("--lora", default=None, metavar="FOLDER",
                   help="a LoRA adapter folder (PEFT's adapter_config.json and weights) merged into the model at load")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template's text) to use instead of the model's own")
    p.add_argument("--prefix-cache-mb", type=non_negative_int, default=DEFAULT_PREFIX_CACHE_MB,
                   help="memory for prompt chunks already read, reused by later prompts that start with the same "
                        "tokens (a chat's next turn, a shared system prompt); exact. 0 turns it off "
                        f"(default {DEFAULT_PREFIX_CACHE_MB})")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """The draft tree's size, depth and width; defaults from :class:`~sot.drafters.TreeBudget`
    and :data:`~sot.drafters.DRAFT_TOP_K`."""
    p.add_argument("--max-nodes", "--budget", dest="max_nodes", type=positive_int, default=TreeBudget.max_nodes,
                   help="nodes a sequence verifies per step at most, root included, whatever drafted them "
                        f"(default {TreeBudget.max_nodes})")
    p.add_argument("--max-depth", type=non_negative_int, default=TreeBudget.max_depth,
                   help=f"how far a draft tree may look ahead (default {TreeBudget.max_depth}; 0: no drafts, "
                        "plain decoding through the same engine)")
    p.add_argument("--predictor-nodes", type=positive_int, default=TreeBudget.predictor_nodes,
                   help="nodes of the state predictor's own tree at most; prompt lookup and suffix trees, which "
                        f"cost no model pass, may add more up to --max-nodes (default {TreeBudget.predictor_nodes})")
    p.add_argument("--predictor-depth", type=non_negative_int, default=TreeBudget.predictor_depth,
                   help="levels of the state predictor's own tree at most, one predictor pass each "
                        f"(default {TreeBudget.predictor_depth})")
    p.add_argument("--draft-top-k", dest="draft_top_k", type=positive_int, default=DRAFT_TOP_K,
                   help=f"children per expanded node of a state-predictor tree; the width of --policy static trees "
                        f"(default {DRAFT_TOP_K})")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """The commit policy's flags; defaults from :class:`~sot.policy.PolicyConfig`."""
    p.add_argument("--policy", choices=[k.value for k in PolicyKind], default=PolicyConfig.kind.value,
                   help="commit policy: heuristic (default: cost model + fallback), learned (a trained acceptance "
                        "model + cost model + fallback), rl (the heuristic's choices made by a network trained "
                        "by reinforcement on simulated tokens/s), auto (learned when an acceptance model fits the "
                        "model, else heuristic) or static (a fixed tree of top-k nodes per depth)")
    p.add_argument("--policy-model", default=None,
                   help="acceptance model of --policy learned, or network of --policy rl (default: the one "
                        "shipped for the default model)")
    p.add_argument("--warmup", type=non_negative_int, default=PolicyConfig.warmup,
                   help="tokens decoded plainly at the start of a sequence")
    p.add_argument("--fallback-threshold", type=non_negative_float, default=PolicyConfig.fallback_threshold,
                   help="fall back to plain decoding when recent speed / plain speed drops below this")
    p.add_argument("--disable-above", type=non_negative_int, default=PolicyConfig.disable_above,
                   help="a fixed rule instead of batch planning: no speculation while more than N sequences "
                        "run (0: off, the default)")


def add_adapt_args(p: argparse.ArgumentParser) -> None:
    """``--adapt`` and ``--adapt-budget`` (for generate, chat and serve)."""
    p.add_argument("--adapt", action="store_true",
                   help="test-time adaptation: the state predictor keeps learning from what the verify passes "
                        "show, between steps, within --adapt-budget (output is unchanged: the target verifies)")
    p.add_argument("--adapt-budget", type=probability, default=ADAPT_BUDGET,
                   help=f"adaptation time as a fraction of decoding time (default {ADAPT_BUDGET})")


def adapt_from_args(args: argparse.Namespace) -> AdaptConfig | None:
    """The :class:`~sot.online.adapt.AdaptConfig` of ``--adapt`` (``None`` without it)."""
    if not getattr(args, "adapt", False):
        return None
    from sot.online.adapt import AdaptConfig

    return AdaptConfig(budget=args.adapt_budget)


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    return PolicyConfig(kind=PolicyKind(args.policy), warmup=args.warmup, fallback_threshold=args.fallback_threshold,
                        model_path=args.policy_model, disable_above=args.disable_above)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=GenerationParams.max_new_tokens,
                   help="tokens each answer generates at most")
    p.add_argument("--temperature", type=non_negative_float, default=SamplingParams.temperature,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=probability, default=SamplingParams.top_p,
                   help="nucleus sampling: sample from the likeliest tokens whose probabilities add up to this "
                        "(1: off)")
    p.add_argument("--top-k", type=non_negative_int, default=SamplingParams.top_k, help="sampling top-k (0: off)")
    p.add_argument("--min-p", type=unit_interval, default=SamplingParams.min_p,
                   help="drop tokens less likely than this fraction of the most likely one (0: off)")
    p.add_argument("--seed", type=int, default=SamplingParams.seed,
                   help="the sampling noise's key: with --sampling coupled the same seed gives the same sample "
                        "(with rejection it also depends on the drafts) (default %(default)s)")
    p.add_argument("--sampling", choices=[m.value for m in SamplingMode], default=SamplingParams.mode.value,
                   help="coupled (default): a seeded sample is the same text whatever was drafted, as plain "
                        "decoding's; rejection: recursive rejection sampling. Both are exact in distribution")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--min-tokens", type=non_negative_int, default=GenerationParams.min_tokens,
                   help="no end-of-sequence token, and no stop string ending, before this many tokens")
    p.add_argument("--repetition-penalty", type=positive_float, default=SamplingParams.repetition_penalty,
                   help="divide (multiply, if negative) the logit of every token seen in the prompt or the "
                        "answer by this (1: off)")
    p.add_argument("--frequency-penalty", type=penalty, default=SamplingParams.frequency_penalty,
                   help="subtract this from a token's logit per time it occurs in the answer (-2 to 2)")
    p.add_argument("--presence-penalty", type=penalty, default=SamplingParams.presence_penalty,
                   help="subtract this from the logit of every token in the answer (-2 to 2)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS", type=_logit_bias,
                   help="add BIAS (-100 to 100) to token id TOKEN's logit (repeatable)")


def add_chat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default: on for chat models)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="feed prompts as raw text")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that states each option's default where its text does not already say it (an option
    without a text gets the default alone)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._default_text(action):
            action = copy.copy(action)
            action.help = self._default_text(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        extra = self._default_text(action)
        return f"{text} {extra}" if extra and "default" not in text.lower() else text

    @staticmethod
    def _default_text(action: argparse.Action) -> str:
        value = action.default
        empty = value is None or value is False or value is argparse.SUPPRESS or (
            isinstance(value, (str, list, tuple)) and not value)
        return "(default: %(default)s)" if action.option_strings and action.nargs != 0 and not empty else ""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit status 2 and each option's default
    in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def check_load_args(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, loading options that cannot work: a suffix store that
    could not be written, a device this machine lacks, a chat template that is neither Jinja
    nor a file, a predictor or policy file that does not exist, a policy model for a policy
    that reads none, a float16 KV cache for a bfloat16 engine."""
    from sot.models.loading import resolve_device
    from sot.prompts import read_chat_template

    if getattr(args, "kv_cache_dtype", "auto") == "float16" and args.dtype == "bfloat16":
        from sot.models.loading import KV_FLOAT16_NEEDS_FLOAT32

        raise SoTError(KV_FLOAT16_NEEDS_FLOAT32)
    store = getattr(args, "suffix_store", None)
    check_output_path(store, "--suffix-store")
    if store and os.path.exists(store) and not os.path.isfile(store):  # (a pipe or a device: read, then replaced)
        raise SoTError(f"--suffix-store {store}: not a regular file; give a file path")
    if store and getattr(args, "drafter", "auto") not in ("auto", DrafterKind.SUFFIX.value):
        raise SoTError(f"--suffix-store needs a drafter that drafts from earlier answers (--drafter auto or suffix), "
                       f"not {args.drafter}")
    if getattr(args, "predictor", None) and getattr(args, "drafter", "auto") not in ("auto", DrafterKind.STATE.value):
        raise SoTError(f"--predictor is read by --drafter auto and state only, not by {args.drafter}")
    resolve_device(args.device)
    if getattr(args, "chat_template", None):
        read_chat_template(args.chat_template)
    if getattr(args, "lora", None) and not Path(args.lora).is_dir():
        raise SoTError(f"--lora {args.lora}: no such folder")
    for flag, path in (("--predictor", getattr(args, "predictor", None)),  # (a file, or an EAGLE-3 folder)
                       ("--policy-model", getattr(args, "policy_model", None))):
        if path and not Path(path).exists():
            raise SoTError(f"{flag} {path}: no such file or folder")
    if getattr(args, "policy_model", None) and Path(args.policy_model).is_dir():
        raise SoTError(f"--policy-model {args.policy_model}: is a folder; give the policy's file")
    if hasattr(args, "policy"):
        policy_from_args(args)


def load_sot(args: argparse.Namespace, batch: int = 1) -> SoT:
    """The :class:`~sot.api.SoT` the model, drafter, dtype and device options name, loaded with
    a line on stderr saying what is being loaded. ``batch``: the sequences it will decode
    together, which ``--dtype auto`` chooses its mode for."""
    from sot.api import SoT
    from sot.dtype_choice import resolve
    from sot.models.loading import resolve_device

    check_load_args(args)
    apply_threads(args)
    if not sys.stderr.isatty():  # (a log, not a terminal: the weights' loading bars would be lines of noise)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    # (the int8 mode runs on the CPU: with a GPU visible, auto still means the CPU for it)
    device = resolve_device("cpu" if args.dtype == "int8" and args.device == "auto" else args.device)
    choice = resolve(args.dtype, args.model, args.drafter, args.predictor, device=str(device), batch=batch)
    print(f"loading {args.model} ({choice.dtype} on {device}, drafter {args.drafter}) ...", file=sys.stderr)
    if args.verbose:
        print(choice.summary(), file=sys.stderr)
    sot = SoT.load(args.model, drafter=args.drafter, dtype=choice.dtype, max_nodes=args.max_nodes,
                   max_depth=args.max_depth, predictor=args.predictor, predictor_nodes=args.predictor_nodes,
                   predictor_depth=args.predictor_depth, top_k=args.draft_top_k,
                   policy=policy_from_args(args), suffix_store=getattr(args, "suffix_store", None),
                   suffix_per_tenant=getattr(args, "suffix_tenants", "shared") == "user",
                   adapt=adapt_from_args(args), prefix_cache_mb=args.prefix_cache_mb,
                   chat_template=args.chat_template, lora=args.lora, device=str(device),
                   kv_cache_dtype=args.kv_cache_dtype)
    sot.dtype_choice = choice
    if args.verbose:
        storage = sot.target.weight_storage()
        if storage:
            weights = sum(n for n, _ in storage.values())
            parts = ", ".join(f"{kind} {size / 1e6:.1f} MB ({100 * n / weights:.0f}% of the weights)"
                              for kind, (n, size) in sorted(storage.items(), key=lambda kv: -kv[1][1]))
            total = sum(size for _, size in storage.values())
            print(f"products read {total / 1e6:.1f} MB a token: {parts}", file=sys.stderr)
    return sot


def stop_string(text: str) -> str:
    """An argparse type: a stop string, which cannot be empty (it would end every answer at once)."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return text


def read_text_file(path: str, flag: str) -> str:
    """The text of the file ``path`` that ``flag`` names (a leading byte-order mark dropped); a
    file that cannot be read, or is not UTF-8, is a :class:`SoTError` naming both."""
    try:
        return Path(path).read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise SoTError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SoTError(f"{flag} {path}: not UTF-8 text") from None


def stdin_or(text: str, name: str) -> str:
    """``text``, or standard input's text when it is ``-``; not UTF-8 is a :class:`SoTError`."""
    if text != "-":
        return text
    try:
        return sys.stdin.buffer.read().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SoTError(f"{name} from standard input: not UTF-8 text") from None


def check_output_path(path: str | None, flag: str) -> None:
    """Stop now, before a model loads, when the file ``path`` (``None``: not asked for) could
    not be written later: it names a folder, or its folder does not exist or takes no new file
    (tried with a file of our own, removed at once: permission bits say nothing of a read-only
    file system, or of what root may do). A device or pipe (``/dev/stdout``) is written as it
    is, so it needs only to be writable itself."""
    if path is None:
        return
    if not path:
        raise SoTError(f"{flag} needs a file path")
    target = Path(path)
    if target.is_dir():
        raise SoTError(f"{flag} {path}: is a folder; give a file path")
    if target.exists() and not target.is_file():
        if not os.access(target, os.W_OK):
            raise SoTError(f"{flag} {path}: not writable")
        return
    folder = Path(os.path.realpath(target)).parent  # (where replace_file writes: beside the file a link names)
    if not folder.is_dir():
        raise SoTError(f"{flag} {path}: the folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".check", dir=folder)
    except OSError as exc:
        raise SoTError(f"{flag} {path}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


#: files a command may read: (flag, args attribute)
INPUT_FILES = (("--prompts", "prompts"), ("--from", "from_file"), ("--chat-template", "chat_template"),
               ("--grammar", "grammar"), ("--tools", "tools"), ("--json-schema", "json_schema"),
               ("--predictor", "predictor"), ("--policy-model", "policy_model"), ("--model", "model"))
#: files a command may write (a suffix store is read first, then written back)
OUTPUT_FILES = (("--trace", "trace"), ("--out", "out"), ("--save", "save"), ("--suffix-store", "suffix_store"))


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (existing or not)."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return pa.resolve() == pb.resolve()


def check_distinct_files(args: argparse.Namespace) -> None:
    """Stop, before a model loads, when a file the command writes is one it reads or another
    it writes (``--out`` and ``--save`` on one path, ``--trace`` over the ``--prompts`` file):
    the data would be written over without a word."""
    outputs = [(flag, getattr(args, dest, None)) for flag, dest in OUTPUT_FILES]
    outputs = [(flag, path) for flag, path in outputs if isinstance(path, str) and path]
    inputs = [(flag, getattr(args, dest, None)) for flag, dest in INPUT_FILES]
    # (--json-schema, --tools and --chat-template take a file or the text itself: only files count)
    inputs = [(flag, path) for flag, path in inputs if isinstance(path, str) and path and os.path.isfile(path)]
    for i, (flag, path) in enumerate(outputs):
        for other, there in outputs[i + 1:] + [(f, p) for f, p in inputs]:
            if same_file(path, there):
                raise SoTError(f"{flag} {path} is also {other}'s file; writing it would replace what {other} "
                               "names: give another path")


def save_suffix_store(sot: SoT, args: argparse.Namespace) -> None:
    """Write the drafter's earlier answers back to ``--suffix-store``, when given."""
    path = getattr(args, "suffix_store", None)
    if path and sot.suffix_stores is not None:
        sot.save_suffix_store(path)
        print(f"suffix store written to {path} ({sot.suffix_stores.tokens} tokens)", file=sys.stderr)


def _logit_bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        pair = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS (a token id and a number), got {text!r}") from None
    if not abs(pair[1]) <= MAX_LOGIT_BIAS:
        raise argparse.ArgumentTypeError(f"BIAS must be -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, got {bias}")
    return pair


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        sampling=args.sampling,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=dict(args.logit_bias),
    )
