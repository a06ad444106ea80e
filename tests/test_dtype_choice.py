"""``--dtype auto`` chooses the exact mode by measurement, caches the choice, and explains it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import tiny_model_dir
import sot.kernels
from sot import SoT
from sot import dtype_choice as dc
from sot.cli import main
from sot.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", max_positions=160)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    # (only the choices move: the compiled kernels stay in the shared cache)
    monkeypatch.setattr(dc, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.delenv(dc.RULE_ENV, raising=False)
    return tmp_path / "cache"


def _mode(name: str, one: float, sixteen: float, draft: float = 0.0, tau: float = 1.0) -> dc.ModeTiming:
    return dc.ModeTiming(name, {1: one, 16: sixteen}, draft_ms=draft, tau=tau)


def test_a_mode_with_cheap_wide_passes_wins_for_a_drafter_and_loses_without_one() -> None:
    # float32 blocks win the one-row pass; bf16 in hardware keeps a 16-row pass near its one-row cost
    def modes(tau: float) -> list[dc.ModeTiming]:
        return [_mode("float32", 14.7, 60.0, draft=2.0, tau=tau), _mode("bfloat16", 16.0, 18.0, draft=2.0, tau=tau)]

    speculative = modes(2.6)
    dc._expected(speculative, speculative=True)
    f32, bf16 = speculative
    assert bf16.tokens_per_s > f32.tokens_per_s and bf16.depth > f32.depth >= 1
    plain = modes(1.0)
    dc._expected(plain, speculative=False)
    assert plain[0].tokens_per_s == pytest.approx(1000 / 14.7) and plain[0].tokens_per_s > plain[1].tokens_per_s
    # as measured on an AMX machine (issue figures): float32 at 14.7 ms a row wins even speculatively
    # against a bf16 pass of 22 ms, 24 ms at 16 rows
    amx = [_mode("float32", 14.7, 60.0, draft=2.0, tau=1.9), _mode("bfloat16", 22.0, 24.0, draft=2.0, tau=1.9)]
    dc._expected(amx, speculative=True)
    assert amx[0].tokens_per_s > amx[1].tokens_per_s
    # a drafter that is never right decodes plainly: the expected speed is the one-row pass's
    useless = modes(1.0)
    dc._expected(useless, speculative=True)
    assert [m.depth for m in useless] == [0, 0] and useless[0].tokens_per_s == pytest.approx(1000 / 14.7)


def test_a_batch_can_choose_the_mode_one_sequence_does_not() -> None:
    """The figures of an AMX machine: float32 blocks win one row (6.9 ms against 9.5) and lose
    sixteen (39.6 ms against 16.1), so plain decoding picks float32 alone and bfloat16 for a
    batch of 16, from the same timings; a forced mode stays itself."""
    timings = [dc.ModeTiming("float32", {1: 6.9, 2: 9.0, 4: 13.0, 8: 21.0, 16: 39.6}),
               dc.ModeTiming("bfloat16", {1: 9.5, 2: 9.8, 4: 10.5, 8: 12.0, 16: 16.1})]
    alone = dc.DtypeChoice("float32", "cached", "none", timings)
    assert alone.at_batch(1) is alone
    wide = alone.at_batch(16)
    assert (wide.dtype, wide.batch, wide.source) == ("bfloat16", 16, "cached")
    assert [m.tokens_per_s for m in wide.modes] == pytest.approx([16_000 / 39.6, 16_000 / 16.1])
    assert timings[0].tokens_per_s == 0.0, "the cached timings are not rewritten"
    assert alone.at_batch(2).dtype == "float32" and "for batches of 16" in wide.summary()
    # a drafter's batch verifies every sequence's chain in one pass, the chains' rows summed
    spec = [dc.ModeTiming("float32", {1: 6.9, 16: 39.6}, draft_ms=2.0, tau=2.0, probe_tokens=48),
            dc.ModeTiming("bfloat16", {1: 9.5, 16: 16.1}, draft_ms=2.0, tau=2.0, probe_tokens=16)]
    dc._expected(spec, speculative=True, batch=4)
    a = 0.5
    for m in spec:
        rows = [m.verify(4 * (d + 1)) + d * 4 * 0.002 for d in range(16)]
        best = max(4 * sum(a**k for k in range(d + 1)) / rows[d] for d in range(1, 16))
        assert m.tokens_per_s == pytest.approx(max(best, 4 / m.verify(4)))
    forced = dc.DtypeChoice("float32", "forced", "none")
    assert forced.at_batch(16) is forced


def test_auto_measures_both_modes_once_and_reads_the_choice_back(model_dir: Path, cache: Path,
                                                                 monkeypatch) -> None:
    first = dc.choose_dtype(str(model_dir), "pld", progress=False)
    assert first.source == "measured" and first.path is not None and first.path.is_file()
    assert first.path.parent == cache / "dtype"
    assert [m.dtype for m in first.modes] == list(dc.CANDIDATES)
    for m in first.modes:
        assert set(m.verify_ms) == set(dc.PROBE_ROWS) and all(ms > 0 for ms in m.verify_ms.values())
        assert m.tau >= 1.0 and m.tokens_per_s > 0
    assert first.dtype == max(first.modes, key=lambda m: m.tokens_per_s).dtype
    again = dc.choose_dtype(str(model_dir), "pld", progress=False)
    assert again.source == "cached" and again.dtype == first.dtype and again.modes == first.modes
    # another drafter is another choice, and so is another build of the kernels (or a switch
    # that bypasses them); a damaged file is measured again
    assert dc.cache_path(str(model_dir), "none", None) != first.path
    real = sot.kernels.build_key
    monkeypatch.setattr(sot.kernels, "build_key", lambda: "another-build")
    assert dc.cache_path(str(model_dir), "pld", None) != first.path
    monkeypatch.setattr(sot.kernels, "build_key", real)
    monkeypatch.setenv("SOT_NO_FUSED_BLOCKS", "1")
    assert dc.cache_path(str(model_dir), "pld", None) != first.path
    monkeypatch.delenv("SOT_NO_FUSED_BLOCKS")
    assert dc.cache_path(str(model_dir), "pld", None) == first.path
    first.path.write_text("{not json")
    assert dc.choose_dtype(str(model_dir), "pld", progress=False).source == "measured"
    assert json.loads(first.path.read_text())["dtype"] in dc.CANDIDATES


def test_the_modes_take_turns_and_a_mode_twice_as_slow_stops_early(model_dir: Path, monkeypatch) -> None:
    """The verify passes of the modes are timed in turns, round after round (a busy moment
    slows a round of each, not one mode's whole measurement); a mode twice as slow as another
    at every size after the first round is timed no further and not decoded, and one already
    twice as slow after a short context never reads the long one; a mode that does not fit in
    memory beside the first is loaded after it, alone."""
    from sot.policy import cost

    calls: list[str] = []
    prefills: list[str] = []
    slow = {"float32": 1.0, "bfloat16": 0.9}  # (a mode slower everywhere than an earlier one is not decoded)

    class FakeTimer:
        def __init__(self, target, context, sizes):
            self.name, self.sizes = str(target.dtype).removeprefix("torch."), sizes
            prefills.append((self.name, context))

        def time(self, repeats, bar=None):
            calls.append(self.name)
            return {r: slow[self.name] * (0.010 + 0.001 * r) for r in self.sizes}

    class Bar:  # (counts the steps a progress bar is advanced by)
        n = 0

        def update(self, steps=1):
            self.n += steps

        def set_postfix_str(self, *a, **k):
            pass

    monkeypatch.setattr(cost, "PassTimer", FakeTimer)
    bar = Bar()
    modes = dc.measure_modes(str(model_dir), dc.CANDIDATES, "pld", None, bar)
    # (the second mode first looks at a short context, then, not twice as slow there, the long one)
    assert calls == ["float32", "bfloat16", "bfloat16"] + list(dc.CANDIDATES) * (dc.PROBE_REPEATS - 1), \
        "a round of each mode in turn"
    context = prefills[0][1]
    assert context > dc.SCREEN_CONTEXT
    assert prefills == [("float32", context), ("bfloat16", dc.SCREEN_CONTEXT), ("bfloat16", context)], \
        "each mode reads its context once"
    assert all(m.probe_tokens > 0 for m in modes)
    assert bar.n == dc._steps(dc.CANDIDATES, True), "the bar ends full"
    calls.clear()
    prefills.clear()
    slow["bfloat16"] = 2.5
    bar = Bar()
    modes = dc.measure_modes(str(model_dir), dc.CANDIDATES, "pld", None, bar)
    assert calls == ["float32", "bfloat16"] + ["float32"] * (dc.PROBE_REPEATS - 1)
    assert prefills == [("float32", context), ("bfloat16", dc.SCREEN_CONTEXT)], "stopped before the long context"
    assert modes[1].probe_tokens == 0 and "not decoded" in modes[1].note and "after 16 tokens only" in modes[1].note
    assert bar.n == dc._steps(dc.CANDIDATES, True), "a mode stopped early skips its steps"
    calls.clear()
    loaded: list[str] = []
    real_load = dc._load
    monkeypatch.setattr(dc, "_load", lambda model, name, *a: loaded.append(name) or real_load(model, name, *a))
    monkeypatch.setattr(dc, "_available_bytes", lambda: 0)
    slow["bfloat16"] = 0.9
    modes = dc.measure_modes(str(model_dir), dc.CANDIDATES, "pld", None)
    assert loaded == list(dc.CANDIDATES) and [m.dtype for m in modes] == list(dc.CANDIDATES)
    assert calls == ["float32"] * dc.PROBE_REPEATS + ["bfloat16"] * (1 + dc.PROBE_REPEATS), "one after the other"


def test_a_forced_mode_or_the_rule_skips_the_measurement(model_dir: Path, cache: Path, monkeypatch) -> None:
    forced = dc.resolve("bfloat16", str(model_dir))
    assert (forced.dtype, forced.source, forced.modes) == ("bfloat16", "forced", [])
    with pytest.raises(ConfigError, match="dtype must be one of"):
        dc.resolve("float16", str(model_dir))
    monkeypatch.setenv(dc.RULE_ENV, "rule")
    assert dc.resolve("auto", str(model_dir)).source == "rule"
    assert not (cache / "dtype").exists()


def test_the_library_and_the_cli_run_the_mode_auto_chose(model_dir: Path, cache: Path, capsys) -> None:
    sot = SoT.load(str(model_dir), drafter="none")
    assert sot.dtype_choice.source == "measured"
    assert str(sot.target.dtype).endswith(sot.dtype_choice.dtype)
    rc = main(["generate", "hello", "--model", str(model_dir), "--drafter", "none", "--max-new-tokens", "4",
               "-v", "--json"])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"dtype {sot.dtype_choice.dtype}: cached" in err
    for name in dc.CANDIDATES:  # each mode's timings are printed
        assert any(line.split()[:1] == [name] and "1 rows" in line and "16 rows" in line for line in err.splitlines())
    assert "for batches of" not in err
    # several prompts decoded together: the choice is made for the batch they form (2, not 4)
    prompts = cache.parent / "two.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    rc = main(["generate", "--prompts", str(prompts), "--model", str(model_dir), "--drafter", "none",
               "--max-new-tokens", "4", "--batch-size", "4", "-v", "--json"])
    assert rc == 0
    assert "cached (" in (err := capsys.readouterr().err) and ", for batches of 2\n" in err


def test_an_unwritable_cache_still_chooses(model_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(dc, "cache_root", lambda: blocker / "cache")
    monkeypatch.delenv(dc.RULE_ENV, raising=False)
    choice = dc.choose_dtype(str(model_dir), "none", progress=False)
    assert choice.source == "measured" and choice.path is None and choice.dtype in dc.CANDIDATES
    assert "could not keep the choice" in capsys.readouterr().err
