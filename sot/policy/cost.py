"""The verify cost of a pass by its row count, measured on this machine.

Measuring the curve takes about 15 seconds on the default model on a 2-core AVX2 machine
(about 90 passes of up to 96 rows), so it is kept under ``$SOT_CACHE/costs/`` (default
``~/.cache/sot``) per machine, target weights, dtype, KV cache dtype, compute path and kernel build, and later
loads read it back; delete the folder to measure again. A running engine still rescales the curve to the passes it times
(:meth:`CostModel.observe`), so a busier machine than at measurement is followed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from sot.models.rows import round_up


class CostModel:
    """Seconds of one verify pass as a function of its row count (batch of one sequence),
    interpolated linearly between measured points."""

    def __init__(self, rows: list[int], seconds: list[float]) -> None:
        if not rows or len(rows) != len(seconds):
            raise ValueError("a cost model needs matching rows and seconds")
        order = sorted(range(len(rows)), key=lambda i: rows[i])
        self.rows = [rows[i] for i in order]
        # verify time never decreases with more rows; measurement noise can make it look so
        self.seconds = []
        for i in order:
            self.seconds.append(max([seconds[i]] + self.seconds[-1:]))

    def verify(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[0]:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                f = (rows - r[i - 1]) / (r[i] - r[i - 1])
                return s[i - 1] + f * (s[i] - s[i - 1])
        slope = (s[-1] - s[-2]) / (r[-1] - r[-2]) if len(r) > 1 else 0.0
        return s[-1] + slope * (rows - r[-1])

    def observe(self, rows: int, seconds: float, rate: float = 0.1) -> None:
        """Refine the curve with a pass of ``rows`` rows that took ``seconds`` (a step's own
        timing): the whole curve is scaled toward it by ``rate``, so the model follows the
        machine's load in a long-running server, and the cost that a batch of many sequences
        adds over the one-sequence passes timed at start-up. A single pass moves the curve by at
        most a factor of 2 ** rate."""
        predicted = self.verify(rows)
        if predicted <= 0 or seconds <= 0:
            return
        factor = min(2.0, max(0.5, seconds / predicted)) ** rate
        self.seconds = [t * factor for t in self.seconds]

    @classmethod
    def for_target(cls, target: torch.nn.Module, max_nodes: int) -> "CostModel":
        """Verify time by row count for ``target`` on this machine, measured once per target
        and tree size (batches are costed by their total rows: at least 96 rows are timed, and
        four trees of the largest size) and kept on disk (see the module)."""
        rows = max(96, 4 * max_nodes)
        key = ("sot_cost_model", rows)
        cached = getattr(target, "_sot_costs", {})
        if key not in cached:
            path = cost_cache_path(target, rows)
            model = _read_curve(path) if path is not None else None
            if model is None:
                model = cls.measure(target, rows)
                if path is not None:
                    _write_curve(model, path)
            cached[key] = model
            target._sot_costs = cached
        return cached[key]

    @classmethod
    def measure(cls, target: torch.nn.Module, max_rows: int, context: int = 256, repeats: int = 5,
                sizes: list[int] | None = None) -> "CostModel":
        """Time verify passes of trees of growing size (binary trees, so depth stays small)
        after a ``context``-token prefill (less where the model's context is shorter): one
        warm-up round, then ``repeats`` rounds in which every size takes its turn; each size
        keeps its fastest pass. Every row's logits are computed in the timed pass, also where
        a pass leaves them to compute when read: a step reads fewer (the rows its walk reaches),
        so the curve stays an upper bound, and a deep accepted chain reads most of its rows. In
        a batch, a pass over ``B`` sequences of ``n`` rows is costed as ``verify(B * n)``.
        ``sizes``: the row counts to time (default 1, 2, 4, 8, 12, 16, 24, 32, 48, 64 up to
        ``max_rows``, and ``max_rows``, plus the first row count past each multiple of 16); the
        others are interpolated."""
        if sizes is None:  # (17, 33, ...: a product of ROW_UNIT-row blocks costs a block more there)
            points = {1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 48, 49, 64, 65, 80, 96, 97, 128}
            sizes = sorted(points & set(range(1, max_rows + 1)) | {max_rows})
        last = (getattr(target, "max_positions", None) or 1 << 40) - 1  # the model's last position
        context = max(1, min(context, last - 8))  # (a small context: learned positions end there)
        # (a bar with its ETA in a terminal, where the first load waits on this; none elsewhere)
        with tqdm(total=(repeats + 1) * len(sizes), desc="timing verify passes (once per machine and model)",
                  unit="pass", disable=None, leave=False, dynamic_ncols=True) as bar:
            timings = _time_passes(target, context, sizes, repeats, bar)
        return cls(list(timings), list(timings.values()))


def _time_passes(target: torch.nn.Module, context: int, sizes: list[int], repeats: int, bar) -> dict[int, float]:
    """Fastest verify pass of each tree size after a ``context``-token prefill (see
    :meth:`CostModel.measure`): ``{rows: seconds}``; ``bar`` (a progress bar, or None) counts
    the passes."""
    return PassTimer(target, context, sizes).time(repeats, bar)


class PassTimer:
    """Verify passes of trees of ``sizes`` rows (binary trees) after a ``context``-token
    prefill, made once and timed as often as asked: a caller timing in rounds (the modes of
    ``--dtype auto`` taking turns) reads the context once, not once a round."""

    def __init__(self, target: torch.nn.Module, context: int, sizes: list[int]) -> None:
        from sot.attention import build_tree_layout
        from sot.tree import ancestor_table, tree_from_parents

        self.target, self.sizes = target, list(sizes)
        unit = target.row_multiple
        last = (getattr(target, "max_positions", None) or 1 << 40) - 1
        self.cache = target.new_cache(1, context + max(sizes) + unit + 16)
        gen = torch.Generator().manual_seed(0)
        vocab = target.model.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(0, vocab, (context,), generator=gen)
        target.prefill(self.cache, 0, prompt)
        self.cache.set_length(0, context)
        self.passes = []
        for n in sizes:
            tokens = prompt.repeat(-(-n // context))[-n:]  # (a context shorter than the tree repeats)
            tree = tree_from_parents(tokens.tolist(), [-1] + [(i - 1) // 2 for i in range(1, n)])
            rows = round_up(n, unit)
            ids = torch.full((1, rows), int(tree.tokens[0]))
            ids[0, :n] = torch.tensor(tree.tokens)
            pos = torch.full((1, rows), context)
            pos[0, :n] = (torch.tensor(tree.depths) + context).clamp(max=last)
            layout = build_tree_layout(self.cache.lengths, [ancestor_table(tree, tree.max_depth + 1)], rows,
                                       self.cache)
            self.passes.append((ids, pos, layout))

    def time(self, repeats: int, bar=None) -> dict[int, float]:
        """``{rows: seconds}``: a warm-up round, then ``repeats`` rounds of every size, each
        size keeping its fastest pass; ``bar`` (a progress bar, or None) counts the passes."""
        # Sizes take turns, round after round, and each keeps its fastest pass: a busy moment
        # then slows one round of every size instead of bending the curve, and the minimum is
        # the most repeatable timing of a pass.
        target = self.target
        timings = {n: math.inf for n in self.sizes}
        for round_ in range(repeats + 1):
            for n, (ids, pos, layout) in zip(self.sizes, self.passes):
                target.synchronize()
                t0 = time.perf_counter()
                target.verify(self.cache, ids, pos, layout).logits  # (every row's: see CostModel.measure)
                target.synchronize()
                if round_ > 0:
                    timings[n] = min(timings[n], time.perf_counter() - t0)
                if bar is not None:
                    bar.update()
        return timings


#: bump when the measurement changes, so curves kept by older versions are measured again
COST_FORMAT = 2


def cost_cache_path(target: torch.nn.Module, max_rows: int) -> Path | None:
    """Where the curve of ``target`` timed up to ``max_rows`` rows is kept on this machine
    (``None`` when ``SOT_COST_CACHE=0`` or the target is not on the CPU)."""
    if os.environ.get("SOT_COST_CACHE", "1") == "0" or target.device.type != "cpu":
        return None
    from sot.fingerprint import target_fingerprint
    from sot.kernels import kernels_key
    from sot.machine import machine_key
    from sot.models.loading import cache_root

    model = target.model
    # the weights' layout (float32 panels, 4-bit blocks, bf16) shows in the tensors' dtypes and shapes
    layout = sorted({(str(t.dtype), tuple(t.shape)) for t in model.state_dict().values()})
    key = json.dumps({
        "format": COST_FORMAT, "machine": machine_key(), "target": target_fingerprint(model),
        "layout": hashlib.sha256(repr(layout).encode()).hexdigest()[:16], "dtype": str(target.dtype),
        "fast": target.fast is not None, "int8": target.int8, "row_multiple": target.row_multiple, "rows": max_rows,
        "kv": str(getattr(target, "kv_dtype", target.dtype)),  # (a smaller KV cache: cheaper attention)
        "kernels": kernels_key(),
    }, sort_keys=True, default=str)
    return cache_root() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _read_curve(path: Path) -> CostModel | None:
    try:
        raw = json.loads(path.read_text())
        return CostModel([int(r) for r in raw["rows"]], [float(s) for s in raw["seconds"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no curve kept, or an unreadable one: measure again


def _write_curve(model: CostModel, path: Path) -> None:
    """Keep the curve at ``path``; an unwritable cache costs a measurement next time."""
    from sot.models.loading import keep_json

    try:
        keep_json(path, {"rows": model.rows, "seconds": model.seconds})
    except OSError:
        pass


def chain_speed(a: float, depth: int, verify: Callable[[int], float], draft_pass: float) -> float:
    """Speed over plain decoding of a greedy chain of ``depth`` drafted tokens, each accepted
    with probability ``a`` after its parent; ``verify(rows)`` and ``draft_pass`` in seconds."""
    tokens = sum(a**k for k in range(depth + 1))
    return tokens * verify(1) / (verify(depth + 1) + depth * draft_pass)


def best_speed(a: float, verify: Callable[[int], float], draft_pass: float, max_depth: int = 12) -> tuple[float, int]:
    """The highest speed over plain of a chain at acceptance ``a``, and its depth."""
    return max((chain_speed(a, d, verify, draft_pass), d) for d in range(1, max_depth + 1))
