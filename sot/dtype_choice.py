"""``--dtype auto``: the exact mode that decodes fastest on this machine, chosen by measurement.

Which of float32 and bfloat16 is faster is not a property of the CPU alone. A model dequantized
from GGUF 4-bit blocks streams a sixth of the bytes in float32 (SoT's block kernels decode them
in registers), which wins the one-row pass; where AMX or AVX512-BF16 multiply bfloat16 in
hardware, a 16-row verify pass costs little more than one row, so the policy verifies bigger
trees. Neither is best everywhere, so at the first load of a model on a machine each mode is
timed:

- the target's verify pass of 1, 2, 4, 8 and 16 rows after a 256-token context (as the
  engine's :meth:`sot.policy.CostModel.measure` times them: rounds of every size, each keeping
  its fastest), the modes taking turns round after round, so that a busy moment on a shared
  machine cannot make one mode look slower than it is;
- for a drafter, a short decode with a fixed tree (the ``static`` policy): the drafter's seconds
  per model pass, and its acceptance (tokens per step ``tau`` gives a per-token rate
  ``a = (tau - 1) / tau``, pooled over the modes since it belongs to the drafter).

The expected speed of a mode is then the best chain of the break-even model
(:func:`sot.policy.cost.best_speed`): ``(1 + a + ... + a**d) / (verify(d + 1) + d * draft)``
tokens per second, the best ``d``; for ``--drafter none`` it is ``1 / verify(1)``. The mode
with the higher expected speed wins; the choice and its timings are kept in
``$SOT_CACHE/dtype/`` per machine, model and drafter, so later loads read it back.

For a batch of ``B`` sequences the same timings give the choice
(:meth:`DtypeChoice.at_batch`): a step verifies ``B`` times the rows in one pass, so a mode
whose wide passes are cheap (bfloat16 on AMX tiles) can lose one sequence and win a batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm import tqdm

from sot.machine import machine_key
from sot.models.loading import DTYPES, INT8, MODE_DTYPES, cache_root, keep_json, native_bf16, resolve_model_path

if TYPE_CHECKING:
    from sot.models.adapter import TargetModel

#: modes timed by ``auto``, in the order they are tried (float32 first: exact everywhere)
CANDIDATES = ("float32", "bfloat16")
#: row counts of the timed verify passes
PROBE_ROWS = (1, 2, 4, 8, 16)
#: context length before the timed passes
PROBE_CONTEXT = 256
#: rounds of timed passes (each size keeps its fastest)
PROBE_REPEATS = 4
#: context of the first look at a mode timed after another: a pass costs no more after a
#: shorter context, so a mode already twice as slow there is stopped before it reads
#: :data:`PROBE_CONTEXT` tokens (seconds where bfloat16 is emulated)
SCREEN_CONTEXT = 16
#: tokens of the probe decode that times the drafter (the first mode's; later modes decode
#: :data:`PROBE_TOKENS_AGAIN`, enough to time the drafter, since the acceptance is pooled)
PROBE_TOKENS = 48
PROBE_TOKENS_AGAIN = 16
#: the probe decode's prompt
PROBE_PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain how it works."
#: bump when the measurement changes, so older cached choices are measured again
FORMAT = 2
#: ``SOT_DTYPE_AUTO=rule`` skips the measurement: bfloat16 where the hardware computes it
#: natively, else float32 (the rule ``auto`` followed before it measured)
RULE_ENV = "SOT_DTYPE_AUTO"


@dataclass
class ModeTiming:
    """What one mode measured. Times in milliseconds."""

    dtype: str
    verify_ms: dict[int, float]
    draft_ms: float = 0.0
    tau: float = 1.0
    acceptance: float = 0.0
    depth: int = 0
    tokens_per_s: float = 0.0
    #: tokens of this mode's probe decode (0: not decoded, see ``note``)
    probe_tokens: int = 0
    note: str = ""

    def verify(self, rows: int) -> float:
        """Seconds of a pass of ``rows`` rows (linear between timed sizes)."""
        from sot.policy.cost import CostModel

        pts = sorted(self.verify_ms)
        return CostModel(pts, [self.verify_ms[r] / 1000 for r in pts]).verify(rows)


@dataclass
class DtypeChoice:
    """The mode ``auto`` resolved to, how, and what each mode measured.

    ``source``: ``measured`` (timed now), ``cached`` (read from ``path``), ``rule`` (``SOT_DTYPE_AUTO=rule``
    or a device where the modes are not timed) or ``forced`` (``--dtype`` named a mode)."""

    dtype: str
    source: str
    drafter: str = ""
    modes: list[ModeTiming] = field(default_factory=list)
    path: Path | None = None
    #: the sequences decoded together that the expected speeds are for
    batch: int = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype of the mode."""
        return MODE_DTYPES[self.dtype]

    @property
    def int8(self) -> bool:
        """Whether the products run in 8-bit integers (``--dtype int8``)."""
        return self.dtype == INT8

    def at_batch(self, batch: int) -> "DtypeChoice":
        """The choice for ``batch`` sequences decoded together, from the same timings (a choice
        that was not measured, or a batch of one, is itself). A wide pass costs little more
        than one row where the hardware multiplies bfloat16 in tiles, so the mode that wins one
        sequence can lose a batch."""
        if batch <= 1 or not self.modes or self.source not in ("measured", "cached"):
            return self
        modes = [replace(m, verify_ms=dict(m.verify_ms)) for m in self.modes]
        _expected(modes, speculative=self.drafter != "none", batch=batch)
        best = max(modes, key=lambda m: m.tokens_per_s)
        return DtypeChoice(best.dtype, self.source, self.drafter, modes, self.path, batch)

    def summary(self) -> str:
        """A few lines for ``-v``: the choice, where it came from, each mode's timings."""
        where = f" ({self.path})" if self.path else ""
        per = f", for batches of {self.batch}" if self.batch > 1 else ""
        lines = [f"dtype {self.dtype}: {self.source}{where}{per}"]
        for m in self.modes:
            curve = ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in sorted(m.verify_ms.items()) if r in (1, 16))
            spec = ""
            if m.depth:
                spec = (f"; drafter {m.draft_ms:.2f} ms a pass, tau {m.tau:.2f} (a = {m.acceptance:.2f}), "
                        f"best chain {m.depth}")
            note = f" ({m.note})" if m.note else ""
            lines.append(f"  {m.dtype:9s} {curve}{spec}; expected {m.tokens_per_s:.1f} tok/s{note}")
        return "\n".join(lines)


def _model_key(model: str, drafter: str, predictor: str | None) -> dict:
    path = resolve_model_path(model)
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    stamp = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]
    pred = None
    if predictor is not None:
        pp = Path(predictor)
        pred = (str(pp.resolve()), pp.stat().st_size if pp.is_file() else 0)
    return {"model": str(path.resolve()), "files": stamp, "drafter": drafter, "predictor": pred}


def cache_path(model: str, drafter: str, predictor: str | None) -> Path:
    """Where the choice for this machine, model, drafter and kernel build is kept."""
    from sot.kernels import kernels_key

    key = json.dumps({"format": FORMAT, "machine": machine_key(), "model": _model_key(model, drafter, predictor),
                      "kernels": kernels_key()}, sort_keys=True)
    return cache_root() / "dtype" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _read(path: Path) -> DtypeChoice | None:
    try:
        raw = json.loads(path.read_text())
        modes = [ModeTiming(**{**m, "verify_ms": {int(k): v for k, v in m["verify_ms"].items()}})
                 for m in raw["modes"]]
        if raw["dtype"] not in DTYPES:
            return None
        return DtypeChoice(raw["dtype"], "cached", raw.get("drafter", ""), modes, path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no cache, or an unreadable one: measure again


def _write(choice: DtypeChoice, path: Path) -> None:
    """Keep ``choice`` at ``path`` (atomically); an unwritable cache only costs a new measurement next time."""
    try:
        keep_json(path, {"dtype": choice.dtype, "drafter": choice.drafter, "modes": [asdict(m) for m in choice.modes]})
    except OSError as exc:
        print(f"--dtype auto: could not keep the choice in {path} ({exc}); it will be measured again",
              file=sys.stderr)
        choice.path = None


def _positions(model: torch.nn.Module) -> int:
    """How many positions ``model`` takes (a large number when its config does not say)."""
    from sot.models.support import text_config

    return int(getattr(text_config(model.config), "max_position_embeddings", None) or 1 << 20)


def _probe_decode(target, draft, tokenizer, tokens: int) -> tuple[float, float, int]:
    """A short decode of :data:`PROBE_PROMPT` with a fixed tree: the drafter's seconds per model
    pass (its calls' time per pass; a drafter without a model counts its calls), tokens per step
    and the tokens decoded."""
    from sot.drafters.base import TreeBudget
    from sot.engine import Engine
    from sot.policy import PolicyConfig, PolicyKind
    from sot.prompts import encode, has_chat_template
    from sot.requests import GenerationParams

    # (the probe's trees stay within the row counts it times, PROBE_ROWS; its cached choices were made so)
    budget = TreeBudget(max_nodes=16, max_depth=8)
    engine = Engine(target, draft, budget, policy=PolicyConfig(kind=PolicyKind.STATIC))
    room = _positions(target.model) // 2  # the prompt takes at most half, the answer and a tree the rest
    spent, passes = [0.0], [0]
    propose = draft.propose

    def timed(inputs, budget):
        before, t0 = draft.passes, time.perf_counter()
        out = propose(inputs, budget)
        spent[0] += time.perf_counter() - t0
        passes[0] += max(1, draft.passes - before)
        return out

    draft.propose = timed
    try:
        ids = encode(tokenizer, PROBE_PROMPT, has_chat_template(tokenizer))[-room:]
        new = max(1, min(tokens, room - budget.max_depth - 2))
        result = engine.generate([ids], GenerationParams(max_new_tokens=new))[0]  # (no end-of-text token: all of them)
    finally:
        del draft.propose  # back to the class's method
    return spent[0] / max(1, passes[0]), max(1.0, result.mean_accept_len), len(result.token_ids)


@dataclass
class _Loaded:
    """One mode's target and drafter, loaded for timing."""

    dtype: str
    target: object
    draft: object
    tokenizer: object
    speculative: bool


def _load(model: str, dtype: str, drafter: str, predictor: str | None) -> _Loaded:
    from sot.drafters import DrafterKind, auto_drafter_kind, make_drafter
    from sot.drafters.suffix import SuffixStores
    from sot.models.adapter import TargetModel
    from sot.models.loading import load_model

    loaded = load_model(model, dtype=DTYPES[dtype])
    kind = auto_drafter_kind(loaded.model, predictor) if drafter == "auto" else DrafterKind(drafter)
    stores = SuffixStores() if drafter == "auto" or kind is DrafterKind.SUFFIX else None
    draft = make_drafter(kind, loaded.model, predictor, suffix=stores)
    target = TargetModel(loaded.model, state_layers=draft.state_layers)
    return _Loaded(dtype, target, draft, loaded.tokenizer, kind is not DrafterKind.NONE)


def _bytes(target) -> int:
    """What a loaded target holds in its parameters and buffers (the packed copies the kernels
    read are not counted: they are smaller than a float32 mode's parameters)."""
    model = target.model
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _available_bytes() -> int:
    """Memory the system could still give this process (a large number where it cannot say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def room_beside(target: TargetModel, ratio: float = 1.0) -> bool:
    """Whether the system could hold another copy of the model ``target`` holds beside it, in a
    mode of ``ratio`` times its bytes (2.0: float32 beside bfloat16): twice that still free."""
    return 2 * ratio * _bytes(target) < _available_bytes()


def measure_modes(model: str, names: tuple[str, ...], drafter: str, predictor: str | None,
                  bar=None) -> list[ModeTiming]:
    """Time ``model`` in each mode of ``names``: verify passes by rows and, with a drafter, a
    probe decode. ``bar`` (a progress bar, or None) counts the steps :func:`_steps` names.

    The modes are loaded together where memory allows it (twice the first mode's bytes free),
    and their verify passes are timed in turns, round after round (each round times every size
    of each mode; each size keeps its fastest pass): a busy moment on a shared machine then
    slows one round of every mode instead of one mode's whole measurement. A mode that does
    not fit beside the first is timed after it, alone."""
    def load(name: str) -> _Loaded:
        loaded = _load(model, name, drafter, predictor)
        _advance(bar, f"{name} loaded")
        return loaded

    first = load(names[0])
    together, rest = [first], list(names[1:])
    while rest and room_beside(first.target):
        together.append(load(rest.pop(0)))
    timings = _time_in_turns(together, [], bar)
    del first, together
    for name in rest:
        timings += _time_in_turns([load(name)], timings, bar)
    return timings


def _steps(names: tuple[str, ...], speculative: bool) -> int:
    """The steps of measuring ``names`` for a progress bar: per mode its load, its rounds of
    passes and, with a drafter, its probe decode (a mode stopped early skips the rest)."""
    return len(names) * (1 + PROBE_REPEATS + int(speculative))


def _advance(bar, what: str, steps: int = 1) -> None:
    if bar is not None:
        bar.set_postfix_str(what, refresh=False)
        bar.update(steps)


def _time_in_turns(group: list[_Loaded], earlier: list[ModeTiming], bar=None) -> list[ModeTiming]:
    """The timings of the modes of ``group`` (see :func:`measure_modes`), after ``earlier``
    ones. After the first round, a mode whose passes take twice another's at every size cannot
    be faster: it is timed no further and skips the probe decode (minutes where bfloat16 is
    emulated); its drafter pass is then taken as the faster mode's, scaled by the ratio of their
    one-row passes. A mode timed after another is first timed after :data:`SCREEN_CONTEXT`
    tokens, and stopped there if that already takes twice as long."""
    from sot.policy.cost import CostModel, PassTimer

    sizes = list(PROBE_ROWS)
    context = max(1, min(PROBE_CONTEXT, _positions(group[0].target.model) - 2 * max(PROBE_ROWS)))
    best = {m.dtype: {r: float("inf") for r in sizes} for m in group}
    timers: dict[str, PassTimer] = {}  # (each mode reads its context once, at its first round)
    live, stopped, screened = list(group), [], set()
    measured = {t.dtype: [t.verify_ms[r] / 1000 for r in sizes] for t in earlier}  # (seconds by size)

    def twice_as_slow(name: str, mine: list[float]) -> bool:  # than another mode, at every size
        return any(all(2 * a <= b for a, b in zip(other, mine)) for o, other in measured.items() if o != name)

    for round_ in range(PROBE_REPEATS):
        for m in live:
            if round_ == 0 and measured and context > SCREEN_CONTEXT:
                first_look = PassTimer(m.target, SCREEN_CONTEXT, sizes).time(1)
                if twice_as_slow(m.dtype, [first_look[r] for r in sizes]):
                    best[m.dtype] = first_look
                    screened.add(m.dtype)
                    _advance(bar, f"{m.dtype} passes, round 1")
                    continue
            if m.dtype not in timers:
                timers[m.dtype] = PassTimer(m.target, context, sizes)
            timed = timers[m.dtype].time(1)
            best[m.dtype] = {r: min(best[m.dtype][r], timed[r]) for r in sizes}
            if round_ == 0:
                measured[m.dtype] = [best[m.dtype][r] for r in sizes]
            _advance(bar, f"{m.dtype} passes, round {round_ + 1}")
        if round_ == 0:
            measured.update({m.dtype: [best[m.dtype][r] for r in sizes] for m in group})
            stopped = [m for m in live if twice_as_slow(m.dtype, measured[m.dtype])]
            live = [m for m in live if m not in stopped]
            for m in stopped:  # (its later rounds and its probe decode are skipped)
                _advance(bar, f"{m.dtype} stopped: twice as slow", PROBE_REPEATS - 1 + int(m.speculative))
    timers.clear()
    out: list[ModeTiming] = []
    for m in group:
        curve = CostModel(sizes, [best[m.dtype][r] for r in sizes])
        timing = ModeTiming(m.dtype, {r: curve.verify(r) * 1000 for r in PROBE_ROWS})
        if m.speculative:
            _probe(m, timing, earlier + out)
            if m not in stopped:
                _advance(bar, f"{m.dtype} drafter timed")
        if m.dtype in screened:
            timing.note = "; ".join(filter(None, [timing.note, f"passes timed after {SCREEN_CONTEXT} tokens only"]))
        out.append(timing)
    return out


def _probe(m: _Loaded, timing: ModeTiming, earlier: list[ModeTiming]) -> None:
    """The drafter's pass time and tau for ``timing``: a probe decode, or an ``earlier`` mode's
    figures where that mode's passes are at least as fast at every size."""
    for other in earlier:
        if all(other.verify_ms[r] <= timing.verify_ms[r] for r in PROBE_ROWS):
            timing.draft_ms = other.draft_ms * timing.verify_ms[1] / other.verify_ms[1]
            timing.tau = other.tau
            timing.note = f"slower than {other.dtype} at every size: not decoded"
            return
    draft_s, timing.tau, timing.probe_tokens = _probe_decode(
        m.target, m.draft, m.tokenizer, PROBE_TOKENS_AGAIN if earlier else PROBE_TOKENS)
    timing.draft_ms = draft_s * 1000


def _expected(modes: list[ModeTiming], speculative: bool, batch: int = 1) -> None:
    """Fill each mode's expected tokens per second for ``batch`` sequences decoded together
    (the drafter's acceptance pooled over modes).

    A batch's step verifies every sequence's rows in one pass, ``verify(batch * rows)``
    (extrapolated past the largest timed pass), and its drafting is priced as one drafter pass
    per sequence, the most it costs (the drafter batches its sequences)."""
    from sot.policy.cost import best_speed

    decoded = [m for m in modes if m.probe_tokens] or modes
    tau = sum(m.tau * max(1, m.probe_tokens) for m in decoded) / sum(max(1, m.probe_tokens) for m in decoded)
    a = (tau - 1) / tau

    def step(m: ModeTiming) -> Callable[[int], float]:
        return lambda rows: m.verify(batch * rows)

    for m in modes:
        one = step(m)(1)
        if not speculative:
            m.tokens_per_s = batch / one
            continue
        ratio, depth = best_speed(a, step(m), batch * m.draft_ms / 1000, max_depth=max(PROBE_ROWS) - 1)
        if ratio <= 1.0:  # no chain pays: the policy decodes plainly
            ratio, depth = 1.0, 0
        m.acceptance, m.depth, m.tokens_per_s = a, depth, batch * ratio / one


def choose_dtype(model: str, drafter: str = "auto", predictor: str | None = None, device: str = "cpu",
                 refresh: bool = False, progress: bool = True) -> DtypeChoice:
    """The mode ``--dtype auto`` runs ``model`` in with ``drafter`` on this machine: read from the
    cache, else measured (a few seconds, once) and cached. ``refresh`` measures again.
    ``progress`` prints a line to stderr while measuring."""
    if os.environ.get(RULE_ENV) == "rule" or torch.device(device).type != "cpu":
        return DtypeChoice("bfloat16" if native_bf16(device) else "float32", "rule", drafter)
    path = cache_path(model, drafter, predictor)
    if not refresh:
        cached = _read(path)
        if cached is not None:
            return cached
    if progress:
        print(f"timing {' and '.join(CANDIDATES)} on this machine for --dtype auto (once; kept in {path.parent})",
              file=sys.stderr, flush=True)
    # (a bar with its ETA in a terminal, where the first load waits on this; none elsewhere)
    with tqdm(total=_steps(CANDIDATES, drafter != "none"), desc="--dtype auto", unit="step",
              disable=None if progress else True, leave=False, dynamic_ncols=True) as bar:
        modes = measure_modes(model, CANDIDATES, drafter, predictor, bar)
    _expected(modes, speculative=drafter != "none")
    best = max(modes, key=lambda m: m.tokens_per_s)
    choice = DtypeChoice(best.dtype, "measured", drafter, modes, path)
    _write(choice, path)
    return choice


def resolve(name: str, model: str, drafter: str = "auto", predictor: str | None = None,
            device: str = "cpu", batch: int = 1) -> DtypeChoice:
    """A ``--dtype`` value as a :class:`DtypeChoice`: ``auto`` by :func:`choose_dtype` for
    ``batch`` sequences decoded together (:meth:`DtypeChoice.at_batch`), a mode as itself."""
    from sot.models.loading import resolve_dtype

    if name == "auto":
        return choose_dtype(model, drafter, predictor, device).at_batch(batch)
    resolve_dtype(name)  # a clear error for a bad name
    return DtypeChoice(name, "forced", drafter)
