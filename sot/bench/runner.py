"""``sot bench``: run methods side by side over the same prompts and write the results.

For each prompt the methods run in turn (A B C, A B C, ...) after a warm-up, so drift of a
shared machine affects them alike. With ``--batch-size`` above 1, each engine method decodes
every prompt as one continuous batch, and the engines take turns a step at a time, each timed
on its own steps (:func:`~sot.bench.methods.run_lockstep`). ``results.json`` schema (``"schema": "sot-bench/1"``):

* ``config``: the run's settings;
* ``methods``: per method, ``tokens_per_s`` (total new tokens / total time),
  ``speedup_vs_hf`` / ``speedup_vs_plain`` (per-prompt tokens/s ratios: median, min, max;
  with ``--batch-size`` above 1 the batch's ratio, min and max null),
  ``mean_accept_len`` (tau), ``accept_hist``, ``accept_rate_per_depth``, ``ttft_s`` (median),
  ``peak_rss_mb`` (process peak during the method's runs), ``peak_rss_over_model_mb`` (that
  peak minus the RSS after loading and warm-up), ``run_rss_growth_mb`` (the most one run
  raised RSS above its own start: the method's working memory), ``phase_share`` (draft / verify /
  bookkeeping), ``identical_to_plain`` ("k/n", greedy only) and ``divergences``;
* ``records``: one entry per (prompt, method) with its tokens and timings;
* ``sweep`` (with ``--sweep``): per setting, tokens/s, tau and speedup vs plain.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sot.bench.conversations import MULTITURN_SETS, load_conversations, per_turn, render, run_conversations
from sot.bench.memory import PeakRSS, current_rss
from sot.bench.methods import (
    LOCKSTEP_PROMPT_BUDGET, METHODS, BenchMethod, EngineMethod, HFMethod, LlamaCppMethod, LockstepStopped, RunRecord,
    forget_answers, run_lockstep,
)
from sot.bench.prompts import BUILTIN, load_prompt_set
from sot.bench.report import aggregate, sweep_plot, write_report
from sot.drafters import DRAFT_TOP_K, DrafterKind, SuffixStores, TreeBudget, auto_drafter_kind, make_drafter
from sot.policy import PolicyConfig, PolicyKind
from sot.engine import GenerationParams
from sot.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from sot.errors import ConfigError, SoTError
from sot.models.adapter import TargetModel
from sot.machine import machine_info
from sot.dtype_choice import DtypeChoice, room_beside
from sot.dtype_choice import resolve as resolve_choice
from sot.models.loading import (
    DEFAULT_DEVICE, DEFAULT_MODEL, DTYPE_CHOICES, DTYPES, default_gguf_path, load_model, load_tokenizer,
    resolve_device,
)
from sot.prompts import encode, has_chat_template
from sot.requests import check_request
from sot.sampling import SamplingMode, SamplingParams
from sot.models.support import text_config

SCHEMA = "sot-bench/1"
SWEEPABLE = {"max-depth": "max_depth", "max-nodes": "max_nodes", "budget": "max_nodes", "draft-top-k": "draft_top_k",
             "predictor-nodes": "predictor_nodes", "predictor-depth": "predictor_depth", "warmup": "warmup",
             "batch-size": "batch_size", "policy": "kind", "dtype": "dtype"}


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one bench run (the CLI fills it)."""

    prompts: str = "humaneval"
    limit: int | None = None
    methods: tuple[str, ...] = ("hf", "plain", "pld")
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the engine methods' KV cache (TargetModel's kv_cache_dtype)
    device: str = DEFAULT_DEVICE
    hf_dtype: str = "float32"
    max_new_tokens: int = GenerationParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    seed: int = SamplingParams.seed
    sampling: str = SamplingParams.mode.value
    max_nodes: int = TreeBudget.max_nodes
    max_depth: int = TreeBudget.max_depth
    predictor_nodes: int = TreeBudget.predictor_nodes
    predictor_depth: int = TreeBudget.predictor_depth
    predictor: str | None = None
    draft_top_k: int = DRAFT_TOP_K
    batch_size: int = 1
    full_vocab: bool = False
    lookup: bool = True
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    chat: bool | None = None
    ignore_eos: bool = False
    warmup_tokens: int = 16
    sweep: tuple[str, tuple[int | str, ...]] | None = None
    multiturn: bool = False  # run each record's turns as a conversation (built-in multi-turn sets always do)
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB  # each engine method's own prefix cache, as `sot generate` has
    #: prompt tokens a batch step reads at most, while the methods take turns (0: whole prompts;
    #: :func:`~sot.bench.methods.run_lockstep`)
    prompt_budget: int = LOCKSTEP_PROMPT_BUDGET
    out: str = "bench-out"
    notes: list[str] = field(default_factory=list)
    #: each engine method's mode, by label, filled when the methods load (``--dtype auto`` can
    #: give methods different ones: :func:`engine_modes`)
    method_dtypes: dict[str, str] = field(default_factory=dict)


def parse_sweep(text: str) -> tuple[str, tuple[int | str, ...]]:
    """``"max-depth=1,2,4"`` -> ``("max-depth", (1, 2, 4))``; ``"policy=heuristic,rl"`` ->
    ``("policy", ("heuristic", "rl"))``; ``"dtype=float32,int8"`` -> ``("dtype", ("float32", "int8"))``."""
    name, _, values = text.partition("=")
    if name not in SWEEPABLE or not values:
        raise ConfigError(f"--sweep takes NAME=v1,v2,... with NAME one of {', '.join(SWEEPABLE)}")
    if name == "dtype":
        modes = tuple(values.split(","))
        known = [d for d in DTYPE_CHOICES if d != "auto"]
        if any(m not in known for m in modes) or len(set(modes)) != len(modes):
            raise ConfigError(f"--sweep dtype= takes distinct modes among {', '.join(known)}, got {values}")
        return name, modes
    if name == "policy":
        kinds = tuple(values.split(","))
        known = [k.value for k in PolicyKind]
        bad = [k for k in kinds if k not in known]
        if bad or len(set(kinds)) != len(kinds):
            raise ConfigError(f"--sweep policy= takes distinct policies among {', '.join(known)}, got {values}")
        return name, kinds
    try:
        parsed = tuple(int(v) for v in values.split(","))
    except ValueError:
        raise ConfigError(f"--sweep values must be integers: {values}") from None
    low = 0 if name == "warmup" else 1
    if any(v < low for v in parsed):
        raise ConfigError(f"--sweep {name}= takes integers >= {low}, got {values}")
    return name, parsed


def _budget(cfg: BenchConfig, **override: int) -> TreeBudget:
    def get(name: str) -> int:
        return override.get(name, getattr(cfg, name))

    return TreeBudget(max_nodes=get("max_nodes"), max_depth=get("max_depth"), predictor_nodes=get("predictor_nodes"),
                      predictor_depth=get("predictor_depth"))


def _predictor_file(method: str) -> str | None:
    """The predictor file of a ``state=FILE`` method (``None`` for any other method)."""
    return method.split("=", 1)[1] if method.startswith("state=") else None


def _drafter(cfg: BenchConfig, method: str, model, top_k: int | None = None):
    """The drafter of an engine method; ``suffix`` and ``auto`` get a global store of their own."""
    file = _predictor_file(method)
    stores = SuffixStores() if method in ("suffix", "auto") else None
    if file is not None:  # another predictor file, compared side by side
        kind, predictor = DrafterKind.STATE, file
    elif method == "auto":
        kind, predictor = auto_drafter_kind(model, cfg.predictor), cfg.predictor
    else:
        kind, predictor = DrafterKind.NONE if method == "plain" else DrafterKind(method), cfg.predictor
    return make_drafter(kind, model, predictor, top_k=top_k or cfg.draft_top_k, full_vocab=cfg.full_vocab,
                        lookup=cfg.lookup, suffix=stores)


def method_label(method: str) -> str:
    """Display name of a method: ``state=runs/x/predictor.safetensors`` shows as ``state[x]``
    (the file's folder, or its stem when the file has another name)."""
    file = _predictor_file(method)
    if file is None:
        return method
    path = Path(file)
    return f"state[{path.parent.name if path.stem == 'predictor' else path.stem}]"


def _is_engine(method: str) -> bool:
    return method in ("plain", "pld", "suffix", "state", "auto") or _predictor_file(method) is not None


def dtype_drafter(methods: tuple[str, ...], predictor: str | None) -> tuple[str, str | None]:
    """The drafter (and predictor) ``--dtype auto`` is timed for: the first engine method that
    drafts (``state=FILE`` with its file), else none."""
    for m in methods:
        name, _, file = m.partition("=")
        if name in ("auto", "pld", "suffix", "state"):
            return name, file or predictor
    return "none", predictor


#: what a bench writes into its ``--out`` folder, besides one ``NAME.jsonl`` of answers per method
OUTPUT_FILES = ("results.json", "report.md", "speedup.png", "accept_hist.png", "accept_depth.png", "sweep.png")


def check_methods(cfg: BenchConfig) -> None:
    """A :class:`ConfigError` for methods, or combinations of them with the other settings,
    that cannot run (checked before anything loads)."""
    if not cfg.methods:
        raise ConfigError(f"--methods names no method; choose from {', '.join(METHODS)}")
    unknown = [m for m in cfg.methods if m not in METHODS and _predictor_file(m) is None]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    for m in cfg.methods:
        file = _predictor_file(m)
        if file is not None and not Path(file).exists():
            raise ConfigError(f"{m}: no such predictor file or EAGLE-3 folder")
    if "llamacpp" in cfg.methods and cfg.model != DEFAULT_MODEL and not cfg.model.endswith(".gguf"):
        raise ConfigError("llamacpp needs a .gguf model (--model FILE.gguf, or the default model)")
    labels = [method_label(m) for m in cfg.methods]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"methods must have distinct names, got {', '.join(labels)}")
    if cfg.batch_size > 1 and not all(_is_engine(m) for m in cfg.methods):
        raise ConfigError("--batch-size above 1 compares engine methods only (plain, pld, suffix, state, auto)")
    if cfg.hf_dtype not in DTYPES:
        raise ConfigError(f"--hf-dtype must be one of {', '.join(DTYPES)}, got {cfg.hf_dtype!r}")
    if cfg.sweep is None:
        return
    name = cfg.sweep[0]
    engines = [m for m in cfg.methods if m != "plain" and _is_engine(m)]
    if name == "dtype" and cfg.batch_size > 1:
        raise ConfigError("--sweep dtype compares modes at batch size 1 (drop --batch-size)")
    if name == "dtype" and (not engines or "plain" not in cfg.methods):
        raise ConfigError("--sweep dtype needs plain and a speculative engine method (state, pld, suffix, auto) "
                          "in --methods")
    if name == "policy" and not engines:
        raise ConfigError("--sweep policy needs a speculative engine method (state, pld, suffix, auto) in --methods")
    if name not in ("dtype", "policy") and not any(m in ("pld", "state") for m in cfg.methods):
        raise ConfigError("--sweep needs an engine method to sweep (pld or state) in --methods")


def check_bench(cfg: BenchConfig) -> list[dict] | None:
    """Check a bench's settings, its output folder and (where it is a file) its prompts before
    any model loads, so that a typo costs no load; returns a multi-turn run's conversations
    (``None`` for single prompts, which are read once the tokenizer is known)."""
    check_methods(cfg)
    multiturn = cfg.multiturn or cfg.prompts in MULTITURN_SETS
    if multiturn and (cfg.batch_size > 1 or cfg.sweep):
        raise ConfigError("conversations run one at a time: drop --batch-size and --sweep with multi-turn sets")
    known = BUILTIN + MULTITURN_SETS
    prompts_file = cfg.prompts not in known
    if prompts_file and Path(cfg.prompts).suffix != ".jsonl" and not Path(cfg.prompts).exists():
        raise ConfigError(f"unknown prompt set {cfg.prompts!r}: use a .jsonl file or one of {', '.join(known)}")
    if not cfg.out:
        raise ConfigError("--out needs a folder")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {cfg.out}: is a file; give a folder")
    if prompts_file and Path(cfg.prompts).resolve().parent == out.resolve():
        ours = set(OUTPUT_FILES) | {f"{method_label(m)}.jsonl" for m in cfg.methods}
        if Path(cfg.prompts).name in ours:
            raise ConfigError(f"--out {cfg.out} would overwrite the prompts file {cfg.prompts}; "
                              "give another folder")
    conversations = load_conversations(cfg.prompts, cfg.limit) if multiturn else None
    if prompts_file and not multiturn:
        load_prompt_set(cfg.prompts, cfg.limit)  # (read again with the chat setting once the tokenizer is known)
    try:  # (made once the rest holds: a folder that cannot be is found before the model loads)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {cfg.out}: cannot make the folder ({exc.strerror or exc})") from None
    return conversations


def _clear_previous(out: Path) -> None:
    """Remove an earlier bench's outputs from ``out``, so that no file of an old run (the
    answers of a method not run this time, a plot not drawn) passes for this one's."""
    old = out / "results.json"
    if not old.is_file():
        return
    try:
        names = list(json.loads(old.read_text()).get("methods", {}))
    except (ValueError, AttributeError):
        names = []
    for name in [*OUTPUT_FILES, *(f"{n}.jsonl" for n in names)]:
        if "/" not in name:
            (out / name).unlink(missing_ok=True)


def per_method_auto(cfg: BenchConfig) -> bool:
    """Whether ``--dtype auto`` picks each engine method's mode for its own drafter: not in a
    sweep (one mode runs every value) nor in conversations (whose turns follow the answers)."""
    return cfg.dtype == "auto" and not cfg.sweep and not (cfg.multiturn or cfg.prompts in MULTITURN_SETS)


def engine_modes(cfg: BenchConfig, device: str) -> dict[str, list[DtypeChoice]]:
    """The modes each engine method runs in, by method.

    ``--sweep dtype`` runs every method in each of its modes. ``--dtype auto`` without a sweep
    gives each method the mode ``auto`` picks for its own drafter at the bench's batch size,
    what ``sot generate --drafter D --batch-size B`` would run: where plain decoding is fastest
    in float32 and speculation in bfloat16 (AMX), each is measured in its own. Otherwise every
    method runs in one mode: the named one, or ``auto``'s for the first drafting method."""
    methods = [m for m in cfg.methods if _is_engine(m)]
    if cfg.sweep and cfg.sweep[0] == "dtype":
        swept = [resolve_choice(name, cfg.model, *dtype_drafter(cfg.methods, cfg.predictor), device=device)
                 for name in cfg.sweep[1]]
        return {m: swept for m in methods}
    if per_method_auto(cfg):
        return {m: [resolve_choice("auto", cfg.model, *dtype_drafter((m,), cfg.predictor), device=device,
                                   batch=cfg.batch_size)] for m in methods}
    one = resolve_choice(cfg.dtype, cfg.model, *dtype_drafter(cfg.methods, cfg.predictor), device=device)
    return {m: [one] for m in methods}


def build_methods(cfg: BenchConfig) -> tuple[list[BenchMethod], object, TargetModel | None]:
    """Load what the requested methods need; returns the methods, tokenizer and engine target
    (plain decoding's, else the first engine method's)."""
    check_methods(cfg)
    device = resolve_device(cfg.device)
    swept_modes = cfg.sweep[1] if cfg.sweep and cfg.sweep[0] == "dtype" else None
    methods: list[BenchMethod] = []
    tokenizer = None
    target = None
    modes = engine_modes(cfg, str(device))
    #: per engine mode (one, each of --sweep dtype's, or each method's own under auto): its
    #: target and the drafters of the methods that run in it
    engines: dict[str, tuple[TargetModel, dict]] = {}

    def engine(mode: DtypeChoice, model: torch.nn.Module) -> tuple[TargetModel, dict]:
        drafters = {m: _drafter(cfg, m, model) for m, choices in modes.items()
                    if mode.dtype in (c.dtype for c in choices)}
        layers = tuple(sorted({layer for d in drafters.values() for layer in d.state_layers}))
        return TargetModel(model, state_layers=layers, kv_cache_dtype=cfg.kv_cache_dtype), drafters

    distinct = list({choice.dtype: choice for choices in modes.values() for choice in choices}.values())
    if not swept_modes:  # (the first drafting method's mode first: the one every method takes without room)
        lead = next((c[0].dtype for m, c in modes.items() if dtype_drafter((m,), None)[0] != "none"), None)
        distinct.sort(key=lambda c: c.dtype != lead)
    first_model = None
    for mode in distinct:
        ratio = mode.torch_dtype.itemsize / distinct[0].torch_dtype.itemsize
        if engines and not swept_modes and not room_beside(engines[distinct[0].dtype][0], ratio):
            modes = {m: distinct[:1] for m in modes}
            engines = {distinct[0].dtype: engine(distinct[0], first_model)}
            cfg.notes.append(f"--dtype auto: too little memory to load {mode.dtype} beside {distinct[0].dtype}; "
                             f"every method runs in {distinct[0].dtype}")
            break
        loaded = load_model(cfg.model, dtype=mode.torch_dtype, device=device, int8=mode.int8)
        tokenizer = loaded.tokenizer
        if first_model is None:
            first_model = loaded.model
        engines[mode.dtype] = engine(mode, loaded.model)
    if engines:
        first = modes.get("plain", next(iter(modes.values())))[0].dtype
        target, drafters = engines[first]
    cfg.method_dtypes.update({method_label(m): " and ".join(c.dtype for c in choices) for m, choices in modes.items()})
    if len(engines) > 1 and not swept_modes:
        cfg.notes.append("--dtype auto: each method runs in the mode auto picks for its drafter"
                         + (f" at batch size {cfg.batch_size}" if cfg.batch_size > 1 else "") + ": "
                         + ", ".join(f"{method_label(m)} {c[0].dtype}" for m, c in modes.items())
                         + "; a method in another mode than plain decoding's is held to plain decoding in its "
                         "own mode, decoded once more untimed")
    for name in cfg.methods:
        if name in ("hf", "hf-pld"):
            hf = load_model(cfg.model, dtype=DTYPES[cfg.hf_dtype], device=device)
            tokenizer = tokenizer or hf.tokenizer
            methods.append(HFMethod(name, hf.model, lookup=10 if name == "hf-pld" else 0))
        elif name == "llamacpp":
            try:
                gguf = str(default_gguf_path()) if cfg.model == DEFAULT_MODEL else cfg.model
                if not gguf.endswith(".gguf"):
                    raise ConfigError("llamacpp needs a .gguf model")
                methods.append(LlamaCppMethod(gguf, threads=torch.get_num_threads()))  # (--threads, as SoT's)
            except ImportError:
                cfg.notes.append("llamacpp skipped: llama-cpp-python is not installed (pip install 'sot[llamacpp]')")
        elif swept_modes and _is_engine(name):
            # each mode's engines side by side, as methods of their own in the alternating rounds
            for mode_name, (mode_target, mode_drafters) in engines.items():
                methods.append(EngineMethod(f"{method_label(name)}[{mode_name}]", mode_target, mode_drafters[name],
                                            _budget(cfg), cfg.policy, cfg.prefix_cache_mb))
        elif cfg.sweep and cfg.sweep[0] == "policy" and name != "plain":
            # the policies side by side, as methods of their own in the alternating rounds; each
            # has a drafter of its own (a drafter keeps per-request state, and engines number
            # their requests alike)
            for i, kind in enumerate(cfg.sweep[1]):
                pk = PolicyKind(kind)  # (a --policy-model goes to the policies that read one)
                policy = dataclasses.replace(cfg.policy, kind=pk,
                                             model_path=cfg.policy.model_path if pk.reads_model else None)
                drafter = drafters[name] if i == 0 else _drafter(cfg, name, target.model)
                methods.append(EngineMethod(f"{method_label(name)}[{kind}]", target, drafter, _budget(cfg),
                                            policy, cfg.prefix_cache_mb))
        else:
            mode_target, mode_drafters = engines[modes[name][0].dtype]
            methods.append(EngineMethod(method_label(name), mode_target, mode_drafters[name], _budget(cfg),
                                        cfg.policy, cfg.prefix_cache_mb))
    if tokenizer is None and methods:  # (llama.cpp alone: the prompts still need the model's tokenizer)
        tokenizer = load_tokenizer(cfg.model)
    return methods, tokenizer, target


def _run_one(method: BenchMethod, ids: list[int], params: GenerationParams, index: int, pid: str) -> RunRecord:
    with PeakRSS() as mem:
        rec = method.run(ids, params)
    rec.prompt_index, rec.prompt_id, rec.peak_rss, rec.rss_growth = index, pid, mem.peak, mem.growth
    return rec


def _run_lockstep(methods: list[BenchMethod], prompts: list[list[int]], params: GenerationParams, ids_of: list[str],
                  width: int, prompt_budget: int, bar: tqdm | None = None) -> list[RunRecord]:
    """Every engine method over all ``prompts`` as a continuous batch of ``width``, taking
    turns a step at a time, each step reading at most ``prompt_budget`` prompt tokens (0:
    whole prompts; :func:`~sot.bench.methods.run_lockstep`); records in method order."""
    engines = [m for m in methods if isinstance(m, EngineMethod)]

    def indexed(got: dict[str, list[RunRecord]]) -> list[RunRecord]:
        runs = []
        for m in engines:
            for rec in got[m.name]:
                rec.prompt_id = ids_of[rec.prompt_index]
            runs += got[m.name]
        return runs

    try:
        got = run_lockstep(engines, prompts, params, width,
                           (lambda name, n: bar.update(n)) if bar is not None else None, prompt_budget or None)
    except LockstepStopped as stop:
        stop.runs = indexed(stop.finished)
        raise
    runs = indexed(got)
    if bar is not None:
        rates = {m.name: sum(r.new_tokens for r in got[m.name]) / max(1e-9, sum(r.wall_time for r in got[m.name]))
                 for m in engines}
        bar.set_postfix_str(", ".join(f"{name} {rate:.1f} tok/s" for name, rate in rates.items()))
    return runs


def _alone_outputs(target: TargetModel, prompts: list[list[int]], params: GenerationParams) -> list[list[int]]:
    """Each prompt decoded plainly alone (batch 1), under its index in the batch (which keys
    coupled sampling's noise): the token ids of each answer."""
    engine = EngineMethod("alone", target, make_drafter(DrafterKind.NONE), TreeBudget()).engine

    def alone(ids: list[int], index: int) -> list[int]:
        rid = engine.add_request(ids, params, index=index)
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.finished and ev.request_id == rid:
                    return ev.result.token_ids
        raise RuntimeError("the request ended without a result")

    return [alone(ids, j) for j, ids in enumerate(tqdm(prompts, desc="alone", unit="run"))]


def _compare_alone(aggregates: dict, runs: list[RunRecord], references: dict[str, list[list[int]]]) -> None:
    """Greedy batches: does every sequence equal plain decoding of its prompt alone (batch 1),
    in its method's mode (``references``: by method, :func:`_references`)? Adds
    ``identical_to_alone`` ("k/n") to each engine method."""
    for name, entry in aggregates.items():
        if name not in references:
            continue
        recs = [r for r in runs if r.method == name]
        same = sum(1 for r in recs if r.token_ids == references[name][r.prompt_index])
        entry["identical_to_alone"] = f"{same}/{len(recs)}"


def _references(methods: list[BenchMethod], names: set[str], prompts: list[list[int]], params: GenerationParams,
                other_mode: set[str], batch: int) -> dict[str, list[list[int]]]:
    """Plain decoding of each prompt alone, in the mode of each engine method of ``names``, by
    method: at batch 1 only for the methods of ``other_mode`` (in another mode than plain
    decoding's, whose outputs plain's own cannot check); in a batch, for every method. Each
    prompt runs alone under the index it had in the batch, which keys coupled sampling's noise,
    so a seeded sample compares with the same draws. One decode per mode, untimed."""
    by_target: dict[int, list[list[int]]] = {}
    out = {}
    for m in methods:
        if not isinstance(m, EngineMethod) or m.name not in names or (batch == 1 and m.name not in other_mode):
            continue
        target = m.engine.target
        if id(target) not in by_target:
            by_target[id(target)] = _alone_outputs(target, prompts, params)
        out[m.name] = by_target[id(target)]
    return out


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark and write its outputs into ``cfg.out``; returns the results dict.

    Interrupted (Ctrl-C) after some prompts, it writes the results of the prompts every method
    finished, marked ``"partial": true``, and raises ``KeyboardInterrupt`` again."""
    conversations = check_bench(cfg)
    multiturn = conversations is not None
    methods, tokenizer, target = build_methods(cfg)
    if not methods:
        raise ConfigError("no method could run" + "".join(f"; {note}" for note in cfg.notes))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    chat = has_chat_template(tokenizer) if cfg.chat is None else cfg.chat
    records = conversations if multiturn else load_prompt_set(cfg.prompts, cfg.limit, chat=chat)
    prompts = [encode(tokenizer, render(r, [], chat) if multiturn else r, chat) for r in records]
    eos = () if cfg.ignore_eos else tuple({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else ())
    params = GenerationParams(
        max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingParams(temperature=cfg.temperature, seed=cfg.seed, mode=SamplingMode(cfg.sampling)),
        eos_token_ids=eos,
    )
    _check_lengths(prompts, records, params, methods, target, multiturn)
    for m in methods:
        if isinstance(m, LlamaCppMethod) and prompts:
            m.fit(max(map(len, prompts)) + params.max_new_tokens)
    warm = dataclasses.replace(params, max_new_tokens=min(cfg.warmup_tokens, cfg.max_new_tokens))
    for m in methods:
        m.run(prompts[0], warm)
        forget_answers(m)  # the warm-up's prompt and answer must not serve the first prompt
    model_rss = current_rss()
    ids_of = [str(r.get("id", i)) if isinstance(r, dict) else str(i) for i, r in enumerate(records)]
    runs: list[RunRecord] = []
    batch = cfg.batch_size
    total = sum(len(r["turns"]) for r in records) if multiturn else len(prompts)
    interrupted = False
    with tqdm(total=total * len(methods), desc="bench", unit="run") as bar:
        try:
            if multiturn:
                run_conversations(methods, tokenizer, records, params, chat, _run_one, bar, runs, cfg.notes)
            elif batch > 1:  # engine methods only: every prompt in one continuous batch each, a step at a time
                runs = _run_lockstep(methods, prompts, params, ids_of, batch, cfg.prompt_budget, bar)
            else:  # methods alternate on every prompt
                for i, ids in enumerate(prompts):
                    for m in methods:
                        rec = _run_one(m, ids, params, i, ids_of[i])
                        runs.append(rec)
                        bar.set_postfix_str(f"{m.name} {rec.tokens_per_s:.1f} tok/s")
                        bar.update()
        except KeyboardInterrupt as stop:
            interrupted = True
            runs = getattr(stop, "runs", runs)  # (a batch's sequences finished before the stop)
    names = [m.name for m in methods]
    if interrupted:
        runs = _complete_prompts(runs, names)
        if not runs:
            raise KeyboardInterrupt
        cfg.notes.append(f"interrupted: the results cover the {len({r.prompt_index for r in runs})} of "
                         f"{total} prompts (turns) that every method finished")
    # coupled sampling makes the engine's seeded outputs token-identical to plain decoding, like greedy
    exact = set(names) if cfg.temperature == 0 else {m.name for m in methods if m.uses_engine and _exact(cfg)}
    # (under --dtype auto, a method in another mode than plain decoding's is held to plain
    # decoding in its own mode)
    other_mode = {m.name for m in methods if isinstance(m, EngineMethod) and m.engine.target is not target
                  and per_method_auto(cfg)}
    references = {}
    if not (interrupted or multiturn):
        try:
            references = _references(methods, exact, prompts, params, other_mode, batch)
        except KeyboardInterrupt:  # (every method finished: the results stand, without that check)
            interrupted = True
            cfg.notes.append("interrupted while each prompt was decoded alone: outputs not compared with it")
    aggregates = aggregate(runs, names, model_rss, exact,
                           {m: dict(enumerate(r)) for m, r in references.items() if m in other_mode})
    if batch > 1:  # a batch's prompts share its steps' time: the ratio is the batch's, with no range
        for entry in aggregates.values():
            if entry.get("speedup_vs_plain"):
                entry["speedup_vs_plain"].update(min=None, max=None)
    if batch > 1 and references:
        _compare_alone(aggregates, runs, references)
    result = {
        "schema": SCHEMA,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "notes"},
        "notes": list(cfg.notes),
        "model_rss_mb": model_rss / 2**20,
        "machine": machine_info(),
        "methods": aggregates,
        "records": [dataclasses.asdict(r) for r in runs],
    }
    if multiturn:
        result["turns"] = per_turn(runs, names)
    _clear_previous(out)  # (only now: a run stopped before this point leaves the earlier results)
    if interrupted:
        result["partial"] = True
        write_report(result, runs, names, records, out)
        print(f"partial results in {out}/", file=sys.stderr)
        raise KeyboardInterrupt
    if cfg.sweep:
        write_report(result, runs, names, records, out)  # (kept if the sweep is stopped)
        try:
            if cfg.sweep[0] == "policy":
                result["sweep"] = policy_sweep(cfg, aggregates, out)
            elif cfg.sweep[0] == "dtype":
                result["sweep"] = dtype_sweep(cfg, aggregates, out)
            else:
                result["sweep"] = run_sweep(cfg, target, prompts, params, out)
        except KeyboardInterrupt:
            print(f"sweep stopped; the methods' results are in {out}/", file=sys.stderr)
            raise
    write_report(result, runs, names, records, out)
    return result


def _complete_prompts(runs: list[RunRecord], names: list[str]) -> list[RunRecord]:
    """The records of the prompts (turns) that every method finished."""
    done: dict[int, set[str]] = {}
    for r in runs:
        done.setdefault(r.prompt_index, set()).add(r.method)
    return [r for r in runs if done[r.prompt_index] >= set(names)]


def _check_lengths(prompts: list[list[int]], records: list, params: GenerationParams, methods: list[BenchMethod],
                   target: TargetModel | None, multiturn: bool) -> None:
    """Every prompt (of a conversation: its first turn) with the answer's budget must fit the
    model's context: checked before anything runs, with the prompt named as the user counts."""
    limit = target.max_positions if target is not None else next(
        (getattr(text_config(m.model.config), "max_position_embeddings", None) for m in methods
         if isinstance(m, HFMethod)), None)
    for i, ids in enumerate(prompts):
        try:
            check_request(ids, params, limit)
        except SoTError as exc:
            rid = records[i].get("id") if isinstance(records[i], dict) else None
            what = "conversation" if multiturn else "prompt"
            raise type(exc)(f"{what} {i + 1}{f' (id {rid})' if rid is not None else ''}: {exc}") from None


def policy_sweep(cfg: BenchConfig, aggregates: dict, out: Path) -> dict:
    """The rows of ``--sweep policy=...``: each policy's figures from the alternating rounds
    (tokens/s and its ratio to plain's, tau, verified rows per step, plain steps)."""
    spec = next(m for m in cfg.methods if m != "plain" and _is_engine(m))  # (check_methods: there is one)
    plain = aggregates.get("plain")
    rows = []
    for kind in cfg.sweep[1]:
        a = aggregates[f"{method_label(spec)}[{kind}]"]
        rows.append({"value": kind, "tokens_per_s": a["tokens_per_s"], "mean_accept_len": a["mean_accept_len"],
                     "speedup_vs_plain": a.get("speedup_vs_plain"), "identical_to_plain": a.get("identical_to_plain"),
                     "tokens_per_s_vs_plain": a["tokens_per_s"] / plain["tokens_per_s"] if plain else None,
                     "mean_tree_size": a.get("mean_tree_size"), "plain_step_share": a.get("plain_step_share")})
    sweep_plot("policy", rows, out)
    return {"name": "policy", "method": spec, "rows": rows}


def dtype_sweep(cfg: BenchConfig, aggregates: dict, out: Path) -> dict:
    """The rows of ``--sweep dtype=...``: per mode, its speculative method's tokens/s against
    that mode's plain decoding (tau, identity), and both against the first mode's."""
    spec = next(m for m in cfg.methods if m != "plain" and _is_engine(m))  # (check_methods: with plain)
    modes = cfg.sweep[1]
    first_plain = aggregates[f"plain[{modes[0]}]"]["tokens_per_s"]
    first_spec = aggregates[f"{method_label(spec)}[{modes[0]}]"]["tokens_per_s"]
    rows = []
    for mode in modes:
        a, p = aggregates[f"{method_label(spec)}[{mode}]"], aggregates[f"plain[{mode}]"]
        rows.append({"value": mode, "tokens_per_s": a["tokens_per_s"], "mean_accept_len": a["mean_accept_len"],
                     "speedup_vs_plain": a.get("speedup_vs_plain"), "identical_to_plain": a.get("identical_to_plain"),
                     "tokens_per_s_vs_plain": a["tokens_per_s"] / p["tokens_per_s"],
                     "plain_tokens_per_s": p["tokens_per_s"],
                     "plain_vs_first": p["tokens_per_s"] / first_plain, "spec_vs_first": a["tokens_per_s"] / first_spec,
                     "mean_tree_size": a.get("mean_tree_size"), "plain_step_share": a.get("plain_step_share")})
    sweep_plot("dtype", rows, out)
    return {"name": "dtype", "method": spec, "rows": rows}


def run_sweep(cfg: BenchConfig, target: TargetModel | None, prompts: list[list[int]], params: GenerationParams, out: Path) -> dict:
    """One speculative method under each setting, alternating with plain on every prompt."""
    name, values = cfg.sweep
    spec = next(m for m in cfg.methods if m in ("pld", "state"))  # (check_methods: there is one, so a target)
    plain = EngineMethod("plain", target, make_drafter(DrafterKind.NONE), _budget(cfg))
    if name == "batch-size":
        return _batch_sweep(cfg, spec, plain, target, prompts, params, values, out)
    variants = []
    drafter = _drafter(cfg, spec, target.model)
    for v in values:
        if name == "draft-top-k":
            variants.append((v, EngineMethod(f"{spec}@{v}", target, _drafter(cfg, spec, target.model, top_k=v),
                                             _budget(cfg), cfg.policy)))
            continue
        if name == "warmup":
            policy = dataclasses.replace(cfg.policy, warmup=v)
            variants.append((v, EngineMethod(f"{spec}@{v}", target, drafter, _budget(cfg), policy)))
            continue
        budget = _budget(cfg, **{SWEEPABLE[name]: v})
        if name == "max-depth":
            budget = dataclasses.replace(budget, max_nodes=max(budget.max_nodes, v + 1))
        elif name == "predictor-depth":  # (the predictor's tree grows within the whole budget: raised to fit)
            nodes = max(budget.predictor_nodes, v + 1)
            budget = dataclasses.replace(budget, predictor_nodes=nodes, max_nodes=max(budget.max_nodes, nodes),
                                         max_depth=max(budget.max_depth, v))
        elif name == "predictor-nodes":
            budget = dataclasses.replace(budget, max_nodes=max(budget.max_nodes, v))
        variants.append((v, EngineMethod(f"{spec}@{v}", target, drafter, budget, cfg.policy)))
    runs: dict[str, list[RunRecord]] = {"plain": []}
    with tqdm(total=len(prompts) * (len(values) + 1), desc=f"sweep {name}", unit="run") as bar:
        for i, ids in enumerate(prompts):
            runs["plain"].append(_run_one(plain, ids, params, i, str(i)))
            bar.update()
            for v, m in variants:
                runs.setdefault(m.name, []).append(_run_one(m, ids, params, i, str(i)))
                bar.update()
    rows = []
    plain_rate = sum(r.new_tokens for r in runs["plain"]) / max(1e-9, sum(r.wall_time for r in runs["plain"]))
    for v, m in variants:
        exact = {m.name} if _exact(cfg) else set()
        agg = aggregate(runs[m.name] + runs["plain"], [m.name, "plain"], 0, exact)[m.name]
        rows.append({"value": v, "tokens_per_s": agg["tokens_per_s"], "mean_accept_len": agg["mean_accept_len"],
                     "speedup_vs_plain": agg["speedup_vs_plain"], "identical_to_plain": agg["identical_to_plain"],
                     "tokens_per_s_vs_plain": agg["tokens_per_s"] / max(1e-9, plain_rate),
                     "mean_tree_size": agg["mean_tree_size"]})
    sweep_plot(name, rows, out)
    return {"name": name, "method": spec, "rows": rows}


def _exact(cfg: BenchConfig) -> bool:
    """Whether the engine's outputs should equal plain decoding's: greedy, or seeded coupled sampling."""
    return cfg.temperature == 0 or cfg.sampling == "coupled"


def _batch_sweep(cfg: BenchConfig, spec: str, plain: EngineMethod, target: TargetModel, prompts: list[list[int]],
                 params: GenerationParams, values: tuple[int, ...], out: Path) -> dict:
    """Plain and the speculative method on all prompts as continuous batches of each size,
    alternating per size; per size: tokens/s against plain, tau, the verified rows per
    sequence and step, the share of sequence steps that drafted, the drafting time's share,
    and, where outputs are exact, how many sequences of each method equal their prompt
    decoded alone (batch size 1's plain answers, or plain decoding alone where 1 is not swept)."""
    method = EngineMethod(spec, target, _drafter(cfg, spec, target.model), _budget(cfg), cfg.policy)
    rows = []
    answers: dict[int, tuple[list[list[int]], list[list[int]]]] = {}  # size -> (plain's, the method's)
    for v in tqdm(values, desc="sweep batch-size", unit="size"):
        got = _run_lockstep([plain, method], prompts, params, [str(i) for i in range(len(prompts))], v,
                            cfg.prompt_budget)
        base, runs = [r for r in got if r.method == "plain"], [r for r in got if r.method == spec]
        answers[v] = ([r.token_ids for r in sorted(base, key=lambda r: r.prompt_index)],
                      [r.token_ids for r in sorted(runs, key=lambda r: r.prompt_index)])
        agg = aggregate(runs + base, [spec, "plain"], 0, {spec} if _exact(cfg) else set())
        a, p = agg[spec], agg["plain"]
        rows.append({"value": v, "tokens_per_s": a["tokens_per_s"], "plain_tokens_per_s": p["tokens_per_s"],
                     "tokens_per_s_vs_plain": a["tokens_per_s"] / max(1e-9, p["tokens_per_s"]),
                     "mean_accept_len": a["mean_accept_len"], "identical_to_plain": a["identical_to_plain"],
                     "mean_tree_size": a["mean_tree_size"],
                     "drafting_share": 1.0 - (a["plain_step_share"] or 0.0),
                     "draft_time_share": a["phase_share"].get("draft", 0.0)})
    if _exact(cfg):
        alone = answers[1][0] if 1 in answers else _alone_outputs(target, prompts, params)
        for row in rows:
            for key, got in zip(("plain_identical_to_alone", "identical_to_alone"), answers[row["value"]]):
                row[key] = f"{sum(a == b for a, b in zip(got, alone))}/{len(alone)}"
    sweep_plot("batch size", rows, out)
    return {"name": "batch-size", "method": spec, "rows": rows}
