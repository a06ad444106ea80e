"""Walk tokens per step against compute for three ways of spending it (see docs/onpolicy.md).

For every predictor file of a run, the greedy chain of ``--depth`` is walked over the target's
own answers (``BENCH_DIR/SET/plain.jsonl``, as ``python -m sot.analysis.walk_acceptance``), and
placed at the seconds of decoding and training the run had spent when it wrote the file:

- ``--fit DIR``: supervised ``fit`` continued from the shipped predictor in chunks
  (``DIR/chunk-N/predictor.safetensors`` with the seconds in ``DIR/chunk-N/train.json``);
- ``--onpolicy DIR``: ``sot train onpolicy`` (``DIR/predictor-itN.safetensors``, seconds from
  ``DIR/checkpoint.pt``);
- ``--adapt``: the last on-policy predictor, adapted while walking: after each answer (in
  order), one update of test-time adaptation on what that answer's verify passes would have
  shown (``sot.online.adapt.OnlineLearner``, as ``--adapt`` runs it).

Usage: .venv/bin/python scripts/onpolicy_study.py BENCH_DIR SET [SET ...] --fit DIR --onpolicy DIR
       --out docs/bench/onpolicy [--adapt]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sot.analysis.walk_acceptance import walk_answer
from sot.bench.prompts import load_prompt_set
from sot.drafters import DEFAULT_PREDICTOR
from sot.drafters.state import load_predictor
from sot.models.loading import load_model
from sot.online.adapt import AdaptConfig, OnlineLearner
from sot.online.record import DEFAULT_TOP_K, OnPolicySequence
from sot.prompts import encode
from sot.train.data import target_states


def answers(loaded, bench_dir: Path, name: str, layers: tuple[int, ...]) -> list[tuple]:
    """``(ids, prompt_len, states)`` of every answer of a set, in the file's order."""
    records = [json.loads(line) for line in (bench_dir / name / "plain.jsonl").read_text().splitlines()]
    items = {str(it["id"]): it for it in load_prompt_set(name, limit=None)}
    out = []
    for rec in records:
        prompt = encode(loaded.tokenizer, items[str(rec["question_id"])], True)
        ids = prompt + rec["choices"][0]["turns"][0]
        out.append((ids, len(prompt), target_states(loaded.model, ids, layers).float()))
    return out


def walk(pred, data, head, depth: int, learner: OnlineLearner | None = None) -> float:
    tokens = steps = 0
    for ids, plen, states in data:
        _, tok, st, walked = walk_answer(pred, states, ids, plen, head, depth)
        tokens, steps = tokens + tok, steps + st
        if learner is not None:  # what the verify passes of this answer showed, then one update
            learner.step(_recorded(ids, plen, states, head, walked, depth))
            learner.finish()
    return tokens / max(steps, 1)


def _recorded(ids, plen, states, head, walked, depth) -> OnPolicySequence:
    s, t = states.shape[1] - 1, len(ids) - 1
    logp = torch.log_softmax(states[:t, s] @ head.T, dim=-1)
    val, idx = logp.topk(DEFAULT_TOP_K, dim=-1)
    idx = idx.to(torch.int32)
    idx[: plen - 1] = -1
    chains = torch.tensor([(r, a, depth) for r, a in walked], dtype=torch.int32).reshape(-1, 3)
    return OnPolicySequence(torch.tensor(ids[:t]), states[:t, :s].bfloat16(), states[:t, s].bfloat16(), idx, val,
                            plen, chains)


def _shown(path: Path) -> str:
    """``path`` relative to the working folder where it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fit_points(folder: Path) -> list[tuple[float, Path]]:
    out = []
    for chunk in sorted(folder.glob("chunk-*"), key=lambda p: int(p.name.split("-")[1])):
        info = json.loads((chunk / "train.json").read_text())
        out.append((float(info["seconds"]), chunk / "predictor.safetensors"))
    return out


def onpolicy_points(folder: Path) -> list[tuple[float, Path]]:
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=False)["state"]
    cfg = json.loads((folder / "config.json").read_text())
    per = cfg["steps_per_iteration"]
    out = []
    for it in range(state["iteration"]):
        f = folder / f"predictor-it{it}.safetensors"
        if f.is_file():
            out.append((float(state["history"][(it + 1) * per - 1]["seconds"]), f))
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_dir")
    ap.add_argument("sets", nargs="+")
    ap.add_argument("--fit", required=True)
    ap.add_argument("--onpolicy", required=True)
    ap.add_argument("--adapt", action="store_true")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_model("default")
    model = loaded.model
    head = model.get_output_embeddings().weight.float()
    shipped = load_predictor(DEFAULT_PREDICTOR, model)
    layers = tuple(shipped.config.state_layers)
    curves = {"supervised fit": [(0.0, DEFAULT_PREDICTOR)] + fit_points(Path(args.fit)),
              "onpolicy": [(0.0, DEFAULT_PREDICTOR)] + onpolicy_points(Path(args.onpolicy))}
    result: dict = {"depth": args.depth, "sets": {}}
    for name in args.sets:
        data = answers(loaded, Path(args.bench_dir), name, layers)
        rows: dict = {}
        for label, points in curves.items():
            rows[label] = []
            for seconds, path in points:
                tau = walk(load_predictor(path, model), data, head, args.depth)
                rows[label].append({"seconds": round(seconds, 1), "file": _shown(path), "walk_tau": round(tau, 4)})
                print(f"{name:17s} {label:15s} {seconds:7.0f}s  walk tau {tau:.3f}  ({path})", flush=True)
        if args.adapt:
            last_s, last_f = curves["onpolicy"][-1]
            with torch.enable_grad():
                pred = load_predictor(last_f, model)
                tau = walk(pred, data, head, args.depth, OnlineLearner(pred, AdaptConfig()))
            rows["onpolicy + adapt"] = [{"seconds": round(last_s, 1), "file": _shown(last_f), "walk_tau": round(tau, 4)}]
            print(f"{name:17s} onpolicy+adapt  {last_s:7.0f}s  walk tau {tau:.3f}", flush=True)
        result["sets"][name] = {"answers": len(data), "curves": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "walk.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "walk-vs-compute.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for label, rows in result["sets"][name]["curves"].items():
            xs, ys = [r["seconds"] / 60 for r in rows], [r["walk_tau"] for r in rows]
            ax.plot(xs, ys, marker="o" if len(rows) > 1 else "*", markersize=6 if len(rows) > 1 else 12, label=label)
        base = result["sets"][name]["curves"]["onpolicy"][0]["walk_tau"]
        ax.axhline(base * 1.10, color="grey", linestyle=":", label="shipped +10%")
        ax.set_title(f"{name} ({result['sets'][name]['answers']} answers)")
        ax.set_xlabel("compute (minutes on 2 cores: decoding + training)")
        ax.set_ylabel(f"walk tokens per step (greedy chain of {result['depth']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
