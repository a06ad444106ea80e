"""Aggregates, the Markdown table and the plots of a bench run."""
from __future__ import annotations

import statistics
import json
from pathlib import Path

from sot.bench.conversations import turn_table
from sot.bench.methods import RunRecord


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _is_plain(method: str) -> bool:
    """``plain``, or one mode's plain decoding under ``--sweep dtype`` (``plain[int8]``)."""
    return method == "plain" or method.startswith("plain[")


def _plain_of(method: str, by_method: dict[str, dict[int, RunRecord]]) -> dict[int, RunRecord]:
    """The plain decoding ``method`` is compared with: under ``--sweep dtype``, its own mode's
    (``state[int8]`` against ``plain[int8]``), else ``plain``."""
    # (the last bracket: state[p1][float32] is held to plain[float32])
    tag = method[method.rindex("["):] if method.endswith("]") and "[" in method else ""
    return by_method.get(f"plain{tag}") or by_method.get("plain", {})


def _ratios(records: dict[int, RunRecord], base: dict[int, RunRecord]) -> list[float]:
    """Per-prompt tokens/s ratio against ``base``, in prompt order."""
    out = []
    for i, rec in sorted(records.items()):
        ref = base.get(i)
        if ref is not None and ref.tokens_per_s > 0 and rec.tokens_per_s > 0:
            out.append(rec.tokens_per_s / ref.tokens_per_s)
    return out


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(records: list[RunRecord], methods: list[str], model_rss: int, exact: set[str],
              references: dict[str, dict[int, list[int]]] | None = None) -> dict[str, dict]:
    """Per-method figures. Speedups are per-prompt tokens/s ratios (median and range).
    ``exact``: the methods whose outputs should equal plain decoding's, compared and counted
    in ``identical_to_plain`` (greedy: all; seeded coupled sampling: the engine's methods).
    ``references``: by method, the token ids by prompt index it is held to instead of the
    ``plain`` method's (plain decoding in the method's own mode, where that differs)."""
    by_method: dict[str, dict[int, RunRecord]] = {m: {} for m in methods}
    for r in records:
        by_method[r.method][r.prompt_index] = r
    out: dict[str, dict] = {}
    for m in methods:
        recs = by_method[m]
        if not recs:
            continue
        tokens = sum(r.new_tokens for r in recs.values())
        seconds = sum(r.wall_time for r in recs.values())
        accepts = [a for r in recs.values() for a in r.accept_lengths]
        steps = len(accepts)
        hist: dict[int, int] = {}
        for a in accepts:
            hist[a] = hist.get(a, 0) + 1
        depth_n = max((len(r.depth_attempts) for r in recs.values()), default=0)
        attempts = [sum(r.depth_attempts[d] for r in recs.values() if d < len(r.depth_attempts)) for d in range(depth_n)]
        accepted = [sum(r.depth_accepts[d] for r in recs.values() if d < len(r.depth_accepts)) for d in range(depth_n)]
        phases: dict[str, float] = {}
        for r in recs.values():
            for k, v in r.phase_seconds.items():
                phases[k] = phases.get(k, 0.0) + v
        peak = max(r.peak_rss for r in recs.values())
        entry = {
            "prompts": len(recs),
            "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "speedup_vs_hf": _summary(_ratios(recs, by_method.get("hf", {}))) if m != "hf" else None,
            "speedup_vs_plain": _summary(_ratios(recs, _plain_of(m, by_method))) if not _is_plain(m) else None,
            # None for methods that do not report steps (transformers, llama.cpp).
            "mean_accept_len": (sum(accepts) / steps) if steps else None,
            "accept_hist": {str(k): v for k, v in sorted(hist.items())},
            "accept_rate_per_depth": [a / t if t else 0.0 for a, t in zip(accepted, attempts)],
            "ttft_s": statistics.median(r.ttft for r in recs.values()),
            "peak_rss_mb": peak / 2**20,
            "peak_rss_over_model_mb": max(0, peak - model_rss) / 2**20,
            "run_rss_growth_mb": max(r.rss_growth for r in recs.values()) / 2**20,
            "phase_share": {k: v / seconds for k, v in phases.items()} if seconds > 0 and phases else {},
            "identical_to_plain": None,
            "divergences": [],
            # commit-policy telemetry (engine methods): verified tree size per step, steps the
            # policy kept the drafter's model idle (warm-up, fallback, or a drafter with no
            # model: prompt lookup, suffix trees; their free drafts may still be verified),
            # and fallbacks per prompt
            "mean_tree_size": (sum(sum(r.tree_sizes) for r in recs.values()) / steps) if steps else None,
            "plain_step_share": (sum(r.plain_steps for r in recs.values()) / steps) if steps else None,
            "fallbacks_per_prompt": (sum(r.fallbacks for r in recs.values()) / len(recs)) if steps else None,
            "prompts_with_fallback": sum(1 for r in recs.values() if r.fallbacks) if steps else None,
        }
        plain = {i: r.token_ids for i, r in _plain_of(m, by_method).items()}
        if references and m in references:
            plain = references[m]
        if m in exact and plain and not _is_plain(m):
            same = 0
            for i, rec in sorted(recs.items()):
                if i not in plain:
                    continue
                where = _first_divergence(rec.token_ids, plain[i])
                if where is None:
                    same += 1
                else:
                    entry["divergences"].append({"prompt_index": i, "first_divergent_token": where})
            entry["identical_to_plain"] = f"{same}/{len([i for i in recs if i in plain])}"
        out[m] = entry
    return out


def _engine_dtype(cfg: dict) -> str:
    """The engine's mode for the report's header: one, or each method's where ``--dtype auto``
    gave methods different ones."""
    modes = cfg.get("method_dtypes") or {}
    if cfg["dtype"] != "auto" or not modes:
        return cfg["dtype"]
    if len(set(modes.values())) == 1:
        return next(iter(modes.values()))
    return "auto (" + ", ".join(f"{m} {d}" for m, d in modes.items()) + ")"


def _fmt_speedup(s: dict | None) -> str:
    if not s:
        return "-"
    if s.get("min") is None:  # a batch: one time for all its prompts, so no per-prompt range
        return f"{s['median']:.2f}x"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def arms_table(got: dict[str, list], label: str) -> str:
    """A Markdown table of arms run side by side on the same prompts (``got``: each arm's
    :class:`~sot.api.Completion` per prompt, the first arm the base): decoding's tokens/s alone
    (the tokens after the first over the time after it), its ratio to the base's, the median
    time to the first token, tau, and how many answers equal the base's token for token."""
    base = next(iter(got))
    rate = {name: sum(len(o.token_ids) - 1 for o in outs) / sum(o.seconds - o.first_token_seconds for o in outs)
            for name, outs in got.items()}
    lines = [f"| {label} | decode tok/s | vs {base} | first token s | tau | answers equal to {base}'s |",
             "|---|---|---|---|---|---|"]
    for name, outs in got.items():
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, got[base]))
        lines.append(f"| {name} | {rate[name]:.1f} | {rate[name] / rate[base]:.3f}x | "
                     f"{statistics.median(o.first_token_seconds for o in outs):.3f} | "
                     f"{statistics.mean(o.mean_accept_len for o in outs):.2f} | {same}/{len(outs)} |")
    return "\n".join(lines)


def markdown_table(aggregates: dict[str, dict]) -> str:
    """The Markdown table of a run (one row per method)."""
    head = (
        "| method | tok/s | speedup vs hf | speedup vs plain | tau | identical to plain | TTFT s | peak RSS MB "
        "| RSS over model MB | run RSS growth MB | draft / verify / other |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for m, a in aggregates.items():
        share = a["phase_share"]
        split = " / ".join(f"{100 * share.get(k, 0):.0f}%" for k in ("draft", "verify", "bookkeeping")) if share else "-"
        rows.append(
            f"| {m} | {a['tokens_per_s']:.1f} | {_fmt_speedup(a['speedup_vs_hf'])} | {_fmt_speedup(a['speedup_vs_plain'])} "
            f"| {_fmt(a['mean_accept_len'])} | {a['identical_to_plain'] or '-'} | {a['ttft_s']:.3f} | {a['peak_rss_mb']:.0f} "
            f"| {a['peak_rss_over_model_mb']:.0f} | {a['run_rss_growth_mb']:.0f} | {split} |"
        )
    return head + "\n".join(rows) + "\n"


#: the note of a report written without matplotlib
NO_PLOTS = "no plots: matplotlib is not installed (pip install matplotlib, or SoT's bench extra)"


def plots(aggregates: dict[str, dict], out: Path) -> list[str]:
    """Speedup bars (with min-max error bars), accepted-length histogram, acceptance per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    names = [m for m, a in aggregates.items() if a["speedup_vs_hf"]]
    if names:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        med = [aggregates[m]["speedup_vs_hf"]["median"] for m in names]
        low = [med[i] - aggregates[m]["speedup_vs_hf"]["min"] for i, m in enumerate(names)]
        high = [aggregates[m]["speedup_vs_hf"]["max"] - med[i] for i, m in enumerate(names)]
        ax.bar(names, med, yerr=[low, high], capsize=4, color="#4a7fb5")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_ylabel("speedup vs HF generate (median, min-max)")
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
        written.append("speedup.png")
    hist_lines, depth_lines = {}, {}
    for m, a in aggregates.items():
        hist = {int(k): v for k, v in a["accept_hist"].items()}
        if hist and max(hist) > 1:
            xs = sorted(hist)
            hist_lines[m] = (xs, [hist[x] / sum(hist.values()) for x in xs])
        if a["accept_rate_per_depth"]:
            rates = a["accept_rate_per_depth"]
            depth_lines[m] = (list(range(1, len(rates) + 1)), rates)
    _line_plot(plt, hist_lines, "tokens committed per step", "share of steps", out / "accept_hist.png")
    _line_plot(plt, depth_lines, "draft depth", "acceptance where reached", out / "accept_depth.png", (0, 1))
    written += ["accept_hist.png", "accept_depth.png"]
    return written


def _line_plot(plt, lines: dict, xlabel: str, ylabel: str, path: Path, ylim: tuple | None = None) -> None:
    """One line per method: ``lines[name] = (xs, ys)``."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (tokens and depths are whole numbers)
    if ylim:
        ax.set_ylim(*ylim)
    if lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_plot(name: str, rows: list[dict], out: Path) -> str | None:
    """Speed against plain (tokens/s where no plain ran) and tau over a swept setting ``name``,
    as ``sweep.png`` in ``out``; returns the file's name (``None`` without matplotlib: the
    report says so)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(6, 3.5))
    xs = [r["value"] for r in rows]
    relative = all(r.get("tokens_per_s_vs_plain") is not None for r in rows)
    ys = [r["tokens_per_s_vs_plain"] if relative else r["tokens_per_s"] for r in rows]
    ax1.plot(xs, ys, marker="o", color="#4a7fb5")
    if relative:
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_xlabel(name)
    if all(isinstance(x, (int, float)) for x in xs):
        ax1.set_xticks(xs)  # (the values swept, not fractions between them)
    ax1.set_ylabel("tokens/s vs plain" if relative else "tokens/s", color="#4a7fb5")
    ax2 = ax1.twinx()
    ax2.plot(xs, [r["mean_accept_len"] for r in rows], marker="s", color="#c0504d")
    ax2.set_ylabel("mean accepted length (tau)", color="#c0504d")
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)
    plt.close(fig)
    return "sweep.png"


def write_report(result: dict, runs: list[RunRecord], names: list[str], records: list, out: Path) -> None:
    """Write ``results.json``, one answers file per method (``NAME.jsonl``, in Spec-Bench's
    layout) and ``report.md`` into ``out``."""
    (out / "results.json").write_text(json.dumps(result, indent=1))
    for name in names:
        with open(out / f"{name}.jsonl", "w") as fh:
            for r in runs:
                if r.method != name:
                    continue
                fh.write(json.dumps({
                    "question_id": r.prompt_id,
                    "model_id": name,
                    "choices": [{"index": 0, "turns": [r.token_ids], "decoding_steps": [len(r.accept_lengths) or r.new_tokens],
                                 "new_tokens": [r.new_tokens], "wall_time": [r.wall_time],
                                 "accept_lengths": [r.accept_lengths or [1] * r.new_tokens]}],
                }) + "\n")
    cfg = result["config"]
    ran = len({r["prompt_index"] for r in result["records"]})  # (fewer than asked when interrupted)
    counted = (f"{len(records)} conversations ({ran} turns)" if "turns" in result
               else f"{ran} prompts" if result.get("partial") else f"{len(records)} prompts")
    lines = [
        f"# sot bench: {cfg['prompts']}",
        "",
        f"model `{cfg['model']}`, engine {_engine_dtype(cfg)} on {cfg.get('device', 'cpu')}, HF {cfg['hf_dtype']}, "
        f"{counted}, "
        f"max {cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}, batch size {cfg['batch_size']}, "
        + _prompt_reads(cfg)
        + f"policy {getattr(cfg['policy']['kind'], 'value', cfg['policy']['kind'])}",
        "",
        _machine_line(result.get("machine")),
        "",
        markdown_table(result["methods"]),
    ]
    lines += _alone_lines(result["methods"])
    if "turns" in result:
        lines += ["", "## by turn", "", *turn_table(result["turns"], names)]
    for note in result["notes"]:
        lines.append(f"- {note}")
    if "sweep" in result:
        sw = result["sweep"]
        lines += ["", f"## sweep of {sw['name']} ({sw['method']})", "",
                  "| value | tok/s | total vs plain | tau | per-prompt speedup vs plain (median) | tree size | identical |",
                  "|---|---|---|---|---|---|---|"]
        for row in sw["rows"]:
            s = (row.get("speedup_vs_plain") or {}).get("median")  # (none for batches: one time per batch)
            vs = row.get("tokens_per_s_vs_plain")
            lines.append(f"| {row['value']} | {row['tokens_per_s']:.1f} | {'-' if vs is None else f'{vs:.2f}x'} | "
                         f"{row['mean_accept_len']:.2f} | {'-' if s is None else f'{s:.2f}x'} | "
                         f"{row.get('mean_tree_size') or 0:.1f} | {row['identical_to_plain'] or '-'} |")
        if sw["name"] == "dtype":
            lines += ["", "| mode | plain tok/s | plain vs the first mode | speculative vs the first mode |",
                      "|---|---|---|---|"]
            lines += [f"| {r['value']} | {r['plain_tokens_per_s']:.1f} | {r['plain_vs_first']:.2f}x | "
                      f"{r['spec_vs_first']:.2f}x |" for r in sw["rows"]]
        if sw["name"] == "batch-size":
            lines += ["", "| batch | plain tok/s | sequence steps the predictor drafted | draft time share "
                          "| identical to alone (plain / method) |", "|---|---|---|---|---|"]
            lines += [f"| {r['value']} | {r['plain_tokens_per_s']:.1f} | {100 * r['drafting_share']:.0f}% | "
                      f"{100 * r['draft_time_share']:.0f}% | {r.get('plain_identical_to_alone', '-')} / "
                      f"{r.get('identical_to_alone', '-')} |" for r in sw["rows"]]
        if sw["name"] == "policy":
            lines += ["", "| policy | sequence steps with the predictor idle |", "|---|---|"]
            lines += [f"| {r['value']} | {100 * (r.get('plain_step_share') or 0):.0f}% |" for r in sw["rows"]]
        if (out / "sweep.png").is_file():
            lines += ["", "![sweep.png](sweep.png)"]
    try:
        written = plots(result["methods"], out)
        lines += ["", *[f"![{w}]({w})" for w in written]]
    except ImportError:  # (the report is worth writing without its plots)
        lines += ["", f"- {NO_PLOTS}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _alone_lines(methods: dict) -> list[str]:
    """The batch-identity line of each method, and a line for each method whose output
    differs from plain decoding's (where: prompt index and first divergent token)."""
    lines = [f"- {m}: every sequence of a batch equals its prompt decoded alone: {a['identical_to_alone']}"
             for m, a in methods.items() if a.get("identical_to_alone")]
    for m, a in methods.items():
        where = a.get("divergences") or []
        if where:
            shown = ", ".join(f"prompt {d['prompt_index']} at token {d['first_divergent_token']}" for d in where[:5])
            more = f" and {len(where) - 5} more" if len(where) > 5 else ""
            lines.append(f"- {m} differs from plain decoding on {len(where)} prompt(s): {shown}{more}")
    return lines


def _prompt_reads(cfg: dict) -> str:
    """How a batch run read its prompts (``"prompts read 64 tokens a step, "``), or nothing
    where the methods did not take turns in batches (or the run predates the setting)."""
    batched = cfg["batch_size"] > 1 or (cfg.get("sweep") or [None])[0] == "batch-size"
    if not batched or "prompt_budget" not in cfg:
        return ""
    budget = cfg["prompt_budget"]
    return f"prompts read {budget} tokens a step, " if budget else "prompts read whole, "


def _machine_line(m: dict | None) -> str:
    if not m:
        return "machine: not recorded"
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    return (f"machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, SIMD {m['simd']}, "
            f"native bf16 {'yes' if m['native_bf16'] else 'no'}, torch {m['torch']}{gpu}")


def _times_plain(ratio: float | None) -> str:
    return "no plain run" if ratio is None else f"{ratio:.2f}x plain"


def summary(result: dict) -> str:
    """One screen of text for the terminal."""
    text = markdown_table(result["methods"]) + "".join(f"{line}\n" for line in _alone_lines(result["methods"]))
    if "turns" in result:
        text += "by turn:\n" + "".join(f"{line}\n" for line in turn_table(result["turns"], list(result["methods"])))
    if "sweep" in result:
        sw = result["sweep"]
        text += f"sweep of {sw['name']} ({sw['method']}): " + ", ".join(
            f"{r['value']}: {_times_plain(r.get('tokens_per_s_vs_plain'))}, tau {r['mean_accept_len']:.2f}"
            for r in sw["rows"]) + "\n"
    return text + "".join(f"note: {n}\n" for n in result["notes"])
