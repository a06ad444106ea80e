"""Step traces: what the drafter proposed, what the policy kept, what the target accepted.

With ``Engine(record_steps=True)`` every sequence's result carries one :class:`StepRecord`
per verify step. :func:`write_trace` writes them as JSON lines, with the state comparison of
:func:`compare_states` (predicted against actual target states); :mod:`sot.trace_page`
draws them as one offline HTML page (``sot trace``).

The JSONL schema, one object per line, each with a ``type``:

* ``run``: ``model``, ``drafter``, ``dtype``, ``created`` (ISO time), ``version``.
* ``sequence``: ``index``, ``prompt_ids``, ``token_ids``, ``pieces`` (each output token's
  text), ``text``, ``finish_reason``, ``tau``, ``seconds``, ``vocab`` (the text of every
  token id in the trees).
* ``step``: ``sequence`` plus the fields of :class:`StepRecord`.
* ``states`` (state drafter only): ``sequence``, ``positions`` (answer positions, each the
  index into ``token_ids``), ``actual`` (``[N, D]`` the target's final normed state behind each
  answer token), and ``compare``: per step and depth, ``{step, depth, position, cosine,
  rel_error}``.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from sot.files import write_output
from sot.tree import DraftTree


@dataclass
class StepRecord:
    """One verify step of one sequence.

    Attributes:
        step: the sequence's step number (0: the prompt's pass, which commits the first
            token; verify steps from 1).
        position: position of the step's root (the last committed token).
        mode: ``prefill`` (step 0), ``draft`` (the drafter's model proposed), ``free`` (a free
            draft, the model idle), ``plain`` (root only) or ``fallback`` (root only, the policy
            fell back).
        tokens, parents, confidences: the proposed tree (root first; ``parents[0] == -1``;
            draft confidence per node, root 1.0).
        verified: per proposed node, whether the policy kept it for verification.
        accepted: proposed-tree indices of the accepted path, root first.
        bonus: the target's own token after the path (``None`` when a stop cut it).
        target_probs: per proposed node, the target's probability of its token given its
            parent (``None`` for the root and for nodes not verified).
        expected: tokens the policy expected the step to commit (``None``: no estimate).
        committed: tokens the step committed.
        draft_seconds, verify_seconds, other_seconds: the batch step's time split.
        batch: sequences in the step's verify pass.
        probe: a drafting step that tests whether drafting pays again after a fallback.
        predicted: per accepted-path node (root first), the state drafter's predicted state
            ``[D]`` for that position (after the predictor's output norm), or ``None``.
    """

    step: int
    position: int
    mode: str
    tokens: list[int]
    parents: list[int]
    confidences: list[float]
    verified: list[bool]
    accepted: list[int]
    bonus: int | None
    target_probs: list[float | None]
    expected: float | None
    committed: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0
    batch: int = 1
    probe: bool = False
    predicted: list[list[float] | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's token path from the root's child down (root: ``()``)."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.size):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return paths


def target_probs(tree: DraftTree, logits: torch.Tensor) -> list[float | None]:
    """``P_target(token | parent)`` of every node of a verified ``tree`` from its logits rows
    ``[N, V]`` (at temperature 1; ``None`` for the root)."""
    if tree.size <= 1:
        return [None]
    probs = torch.softmax(logits[: tree.size].float(), dim=-1)
    parents = torch.tensor(tree.parents[1:])
    tokens = torch.tensor(tree.tokens[1:])
    return [None] + probs[parents, tokens].tolist()


def build_record(
    step: int, position: int, mode: str, proposed: DraftTree, verified: DraftTree, path: list[int],
    committed: list[int], logits: torch.Tensor, expected: float | None,
    predicted: dict[tuple[int, ...], torch.Tensor] | None,
) -> StepRecord:
    """A :class:`StepRecord` from the step's proposed tree, the pruned tree that was verified
    (its ``logits [N, V]``), the accepted ``path`` (indices into ``verified``) and the tokens
    committed; ``predicted`` maps token paths to the drafter's predicted states."""
    prop_paths = node_paths(proposed)
    index = {p: i for i, p in enumerate(prop_paths)}
    ver_paths = node_paths(verified)
    kept = {index[p] for p in ver_paths if p in index}
    probs = target_probs(verified, logits)
    node_probs: list[float | None] = [None] * proposed.size
    for j, p in enumerate(ver_paths):
        if p in index:
            node_probs[index[p]] = probs[j]
    accepted = [index[ver_paths[i]] for i in path]
    bonus = committed[len(path) - 1] if len(committed) >= len(path) else None
    states = None
    if predicted is not None:
        states = []
        for i in path:
            s = predicted.get(ver_paths[i])
            states.append(None if s is None else [round(float(v), 5) for v in s.float().tolist()])
    conf = proposed.draft_probs or [1.0] * proposed.size
    return StepRecord(
        step=step, position=position, mode=mode, tokens=list(proposed.tokens), parents=list(proposed.parents),
        confidences=[round(float(c), 6) for c in conf], verified=[i in kept for i in range(proposed.size)],
        accepted=accepted, bonus=bonus, target_probs=[None if p is None else round(p, 6) for p in node_probs],
        expected=None if expected is None else round(expected, 4), committed=len(committed), predicted=states,
    )


def step_mode(state: Any, key: int, plan: Any, proposed: dict[int, DraftTree]
              ) -> tuple[str, DraftTree | None, bool]:
    """How sequence ``key`` takes a step, as the commit policy's plan decided it: ``(mode,
    proposed tree, probe)`` with mode ``draft``, ``free``, ``fallback`` or ``plain``.

    Args:
        state: the policy's state of the sequence (``None`` if it keeps none).
        plan: the step's :class:`~sot.policy.StepPlan`.
        proposed: the drafter's trees of this step, by sequence key.
    """
    probing = state is not None and state.probing
    if key in proposed:
        return "draft", proposed[key], probing
    if key in plan.free:
        return "free", plan.free[key], False
    # a fallback's plain steps: still counting down, or the last one, which set up the probe
    if state is not None and state.fallbacks > 0 and (state.plain_left > 0 or probing):
        return "fallback", None, False
    return "plain", None, False


def record_step(seqs: list[Any], batch: Any, paths: list[list[int]], events: list[Any], out: Any,
                modes: dict[int, tuple[str, DraftTree | None, bool]], expected: dict[int, float],
                predicted_states: Callable[[int], Any], times: tuple[float, float, float]) -> None:
    """Append each sequence's :class:`StepRecord` of the verify step just taken.

    Args:
        seqs: the step's live requests, in slot order (``[B]``).
        batch: the step's :class:`~sot.verify.VerifyInput` (its trees and ``[B, T]`` positions).
        paths: each sequence's accepted node indices.
        events: each sequence's committed tokens (:class:`~sot.requests.TokenEvent`).
        out: the verify pass's output (``rows``: the ``[N, V]`` logits of each tree's nodes).
        modes: :func:`step_mode` of each sequence, by request id.
        expected: the policy's expected tokens per request id.
        predicted_states: the state drafter's predicted states of a request id.
        times: the step's ``(draft, verify, other)`` seconds.
    """
    roots = batch.positions[:, 0].tolist()  # each tree's root sits at its sequence's length
    for b, (seq, tree, path, ev) in enumerate(zip(seqs, batch.trees, paths, events)):
        mode, proposed, probe = modes.get(seq.id, ("plain", None, False))
        logits = out.rows([out.seq_start(b) + i for i in range(tree.size)])  # [N, V] the tree's rows
        rec = build_record(
            len(seq.result.step_records), roots[b], mode, proposed or tree, tree, path, ev.token_ids,
            logits, expected.get(seq.id), predicted_states(seq.id) if mode == "draft" else None,
        )
        rec.probe = probe
        rec.draft_seconds, rec.verify_seconds, rec.other_seconds = (round(t, 6) for t in times)
        rec.batch = len(seqs)
        seq.result.step_records.append(rec)


def compare_states(model: torch.nn.Module, prompt: list[int], output: list[int],
                   records: Iterable[StepRecord]) -> dict[str, Any]:
    """Run the target once over ``prompt + output`` and compare each step's predicted states
    with the target's final normed hidden state at the same positions.

    Returns ``{positions, actual [N, D], compare: [{step, depth, position, cosine, rel_error}]}``,
    where ``actual[j]`` is the state at the position of answer token ``j``."""
    from sot.models.adapter import transformers_attention
    from sot.train.data import target_states

    ids = list(prompt) + list(output)
    with torch.no_grad(), transformers_attention(model):
        states = target_states(model, ids, ())[:, -1].float()  # [T, D]
    first = len(prompt)
    compare = []
    for rec in records:
        for depth, vec in enumerate(rec.predicted or []):
            pos = rec.position + depth
            if vec is None or pos >= len(ids):
                continue
            pred, real = torch.tensor(vec), states[pos]
            cosine = float(torch.nn.functional.cosine_similarity(pred, real, dim=0))
            rel = float((pred - real).norm() / real.norm().clamp(min=1e-12))
            compare.append({"step": rec.step, "depth": depth, "position": pos,
                            "cosine": round(cosine, 5), "rel_error": round(rel, 5)})
    # the state behind answer token j is the one at its position, first + j
    actual = states[first : first + len(output)]
    return {"positions": list(range(first, first + len(output))),
            "actual": [[round(float(v), 4) for v in row] for row in actual.tolist()], "compare": compare}


@dataclass
class TracedSequence:
    """One traced answer, as :func:`write_trace` writes it and :func:`read_trace` reads it."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    pieces: list[str]
    text: str
    finish_reason: str
    tau: float
    seconds: float
    steps: list[dict[str, Any]] = field(default_factory=list)
    states: dict[str, Any] | None = None
    #: the text of every token id that appears in a tree (as a string key)
    vocab: dict[str, str] = field(default_factory=dict)


def write_trace(path: str | Path, run: dict[str, Any], sequences: list[TracedSequence]) -> None:
    """Write a trace as JSON lines (the schema above), whole or not at all."""
    def write(part: Path) -> None:
        with open(part, "w") as fh:
            head = {"type": "run", "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), **run}
            fh.write(json.dumps(head) + "\n")
            for seq in sequences:
                body = {k: v for k, v in asdict(seq).items() if k not in ("steps", "states")}
                fh.write(json.dumps({"type": "sequence", **body}) + "\n")
                for step in seq.steps:
                    fh.write(json.dumps({"type": "step", "sequence": seq.index, **step}) + "\n")
                if seq.states is not None:
                    fh.write(json.dumps({"type": "states", "sequence": seq.index, **seq.states}) + "\n")

    write_output(path, write)


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[TracedSequence]]:
    """Read a trace written by :func:`write_trace`; raises ``ValueError`` on a malformed file."""
    run: dict[str, Any] = {}
    seqs: dict[int, TracedSequence] = {}
    with open(path, encoding="utf-8") as fh:
        number = 0
        try:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    _read_line(json.loads(line), run, seqs)
        except UnicodeDecodeError:  # (text is decoded ahead in blocks: no line number to give)
            raise ValueError(f"{path}: not UTF-8 text, so not a SoT trace") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a SoT trace line ({exc})") from None
    if not seqs:
        raise ValueError(f"{path}: no traced sequence in it")
    empty = [k for k, s in sorted(seqs.items()) if not s.steps]
    if empty:
        raise ValueError(f"{path}: sequence {empty[0]} has no step lines (the trace was cut short?)")
    return run, [seqs[k] for k in sorted(seqs)]


def _read_line(obj: Any, run: dict[str, Any], seqs: dict[int, TracedSequence]) -> None:
    """Add one parsed line of a trace file to ``run`` and ``seqs``; ``TypeError``,
    ``KeyError`` or ``ValueError`` for a line that is not one :func:`write_trace` writes."""
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON {type(obj).__name__}, not an object")
    kind = obj.pop("type", None)
    if kind == "run":
        run.update(obj)
    elif kind == "sequence":
        index = obj["index"]
        if not _is_int(index) or index in seqs:
            raise ValueError(f"sequence index {index!r} is not a new integer (two traces joined into one file?)")
        seqs[index] = TracedSequence(**obj)
    elif kind == "step":
        owner = _owner(obj, seqs)
        record = StepRecord(**obj)  # every field present, no unknown one
        _check_step(record)
        owner.steps.append(record.to_json())
    elif kind == "states":
        missing = {"positions", "actual", "compare"} - obj.keys()
        if missing:
            raise KeyError(", ".join(sorted(missing)))
        _owner(obj, seqs).states = obj
    elif kind is None:
        raise KeyError("type")
    # a line of a type this version does not know (a later version's) is skipped


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_step(rec: StepRecord) -> None:
    """``TypeError`` unless a step line's fields have the types and lengths ``write_trace``
    writes (the page draws them as they are)."""
    n = len(rec.tokens) if isinstance(rec.tokens, list) else -1
    number = (int, float)
    checks = {
        "step": _is_int(rec.step), "position": _is_int(rec.position), "committed": _is_int(rec.committed),
        "mode": isinstance(rec.mode, str) and rec.mode in ("prefill", "draft", "free", "plain", "fallback"),
        "tokens": n > 0 and all(_is_int(t) for t in rec.tokens),
        "parents": isinstance(rec.parents, list) and len(rec.parents) == n
        and all(_is_int(p) and -1 <= p < i for i, p in enumerate(rec.parents)),
        "confidences": isinstance(rec.confidences, list) and len(rec.confidences) == n
        and all(isinstance(c, number) for c in rec.confidences),
        "verified": isinstance(rec.verified, list) and len(rec.verified) == n
        and all(isinstance(v, bool) for v in rec.verified),
        "accepted": isinstance(rec.accepted, list) and all(_is_int(i) and 0 <= i < n for i in rec.accepted),
        "target_probs": isinstance(rec.target_probs, list) and len(rec.target_probs) == n
        and all(p is None or isinstance(p, number) for p in rec.target_probs),
        "bonus": rec.bonus is None or _is_int(rec.bonus),
        "expected": rec.expected is None or isinstance(rec.expected, number),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise TypeError(f"step {rec.step!r} has a malformed {', '.join(bad)}")


def _owner(obj: dict[str, Any], seqs: dict[int, TracedSequence]) -> TracedSequence:
    """The sequence a step or states line names (its ``sequence`` key, removed)."""
    index = obj.pop("sequence")
    if index not in seqs:
        raise ValueError(f"it names sequence {index!r}, which no earlier sequence line opens")
    return seqs[index]
