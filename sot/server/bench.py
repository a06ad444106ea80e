"""``sot bench-serve``: a load generator for any OpenAI-compatible server.

It streams chat completions at fixed concurrency levels (or at a Poisson request rate) and
measures, per server and level: throughput (generated tokens/s over the run), time to first
token, time per output token after the first (TPOT, the per-request inter-token latency:
``(end - first token) / (tokens - 1)``), and SoT's per-request mean accepted length when
the server reports it. Several servers (``--url`` repeated) are measured in alternating
rounds on the same prompts, so a busy moment of the machine slows each of them alike.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sot.errors import ConfigError

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds from its start)."""

    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    tau: float | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.ok and self.tokens > 1 else None


@dataclass
class LevelResult:
    """One server at one load level (all its rounds)."""

    label: str
    level: str
    wall_seconds: float = 0.0
    requests: list[RequestRecord] = field(default_factory=list)
    #: the server's resident memory after the level (its /metrics), when it reports it
    rss_mb: float | None = None

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.ok]
        tokens = sum(r.tokens for r in ok)
        ttft = sorted(r.ttft for r in ok)
        tpot = sorted(t for r in ok if (t := r.tpot) is not None)
        taus = [r.tau for r in ok if r.tau is not None]
        return {
            "label": self.label, "level": self.level, "requests": len(self.requests), "ok": len(ok),
            "tokens": tokens, "wall_seconds": round(self.wall_seconds, 3),
            "throughput_tok_s": round(tokens / self.wall_seconds, 2) if self.wall_seconds else 0.0,
            "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot),
            "mean_tau": round(statistics.fmean(taus), 3) if taus else None,
            "server_rss_mb": self.rss_mb,
        }


def _percentiles(values: list[float]) -> dict:
    """p50, p90 and p99 of sorted ``values``, interpolated between the two nearest samples
    (NumPy's default, as vLLM's benchmark reports them; the p50 of two samples is their mean)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}

    def pick(q: float) -> float:
        pos = q * (len(values) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(values) - 1)
        return round(values[lo] + (values[hi] - values[lo]) * (pos - lo), 4)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                      timeout: float | None = None) -> RequestRecord:
    """Stream one chat completion and time it; a request still running after ``timeout``
    seconds (None: no limit) is ended and recorded as failed."""
    rec = RequestRecord(ok=False)
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, rec), timeout)
    except asyncio.TimeoutError:
        rec.ok, rec.error = False, f"timed out after {timeout:g} s"
    return rec


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, rec: RequestRecord) -> None:
    """Fill ``rec`` from one streamed chat completion."""
    t0 = time.perf_counter()
    usage = False
    ended: str | None = None  # the choice's finish_reason
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = str(event["error"])
                    return
                if event.get("usage"):
                    rec.tokens, usage = event["usage"]["completion_tokens"], True
                if event.get("sot"):
                    rec.tau = event["sot"].get("mean_accept_len")
                for choice in event.get("choices", []):
                    if choice.get("delta", {}).get("content") and rec.ttft == 0.0:
                        rec.ttft = time.perf_counter() - t0
                    ended = choice.get("finish_reason") or ended
        rec.latency = time.perf_counter() - t0
        if not usage:  # tokens are counted from usage: without it every figure would be wrong
            rec.error = "the stream carried no usage (the server ignored stream_options.include_usage)"
            return
        if ended in ("abort", "error"):  # cut off by the server (a shutdown, a failure): not a finished answer
            rec.error = f"the server ended the answer ({ended}) after {rec.tokens} tokens"
            return
        rec.ok = True
        if rec.ttft == 0.0:
            rec.ttft = rec.latency
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"


async def run_level(url: str, bodies: list[dict], headers: dict, concurrency: int | None, rate: float | None,
                    timeout: float) -> tuple[float, list[RequestRecord]]:
    """Send every body, ``concurrency`` at a time or at a Poisson ``rate``; returns wall time and records."""
    import httpx

    limits = httpx.Limits(max_connections=max(concurrency or 0, 64))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:  # and each read
        t0 = time.perf_counter()
        if rate is not None:
            rng = random.Random(0)
            tasks = []
            for i, body in enumerate(bodies):
                if i:  # (the gaps between arrivals: none after the last, which would count as idle time)
                    await asyncio.sleep(rng.expovariate(rate))
                tasks.append(asyncio.create_task(one_request(client, url, body, headers, timeout)))
            records = list(await asyncio.gather(*tasks))
        else:
            queue = list(enumerate(bodies))
            records: list[RequestRecord | None] = [None] * len(bodies)

            async def user() -> None:
                while queue:
                    i, body = queue.pop(0)
                    records[i] = await one_request(client, url, body, headers, timeout)

            await asyncio.gather(*(user() for _ in range(concurrency or 1)))
        return time.perf_counter() - t0, records


def server_rss_mb(url: str) -> float | None:
    """``process_resident_memory_bytes`` from the server's ``/metrics``, in MiB (None if absent)."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return round(float(line.split()[-1]) / 2**20, 1)
    return None


def _model_id(url: str, headers: dict) -> str:
    import httpx

    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    except httpx.ConnectError as exc:
        raise ConfigError(f"cannot reach {url}: {exc} (is the server running?)") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # (not a URL of a server: no more to say)
        raise ConfigError(f"cannot reach {url}: {exc}") from None
    if resp.status_code != 200:
        raise ConfigError(f"{url}/v1/models answered {resp.status_code}: {resp.text[:200]}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{url}/v1/models did not answer with a list of models (OpenAI's form); "
                          "name the model with --model") from None


def _prompt_slices(args: argparse.Namespace, runs: int) -> list[list[dict]]:
    """The prompt records of each of ``runs`` level-and-round runs, ``--num-prompts`` each,
    taken in turn from the set: no run repeats another's prompts while the set lasts, since a
    server that keeps earlier answers (SoT's suffix store) would draft a repeated prompt's
    answer from its own memory. A set too small is used again from its start, with a note."""
    from sot.bench.prompts import load_prompt_set

    want = args.num_prompts * runs
    records = load_prompt_set(args.prompts, limit=want)
    if not records:
        raise ConfigError(f"prompt set {args.prompts!r} is empty")
    if len(records) < want:
        print(f"bench-serve: {args.prompts} has {len(records)} prompts for {want} requests ({runs} levels and "
              "rounds); prompts repeat, and a server that keeps earlier answers answers repeats faster",
              file=sys.stderr)
    return [[records[(k * args.num_prompts + i) % len(records)] for i in range(args.num_prompts)]
            for k in range(runs)]


def _bodies(args: argparse.Namespace, model: str, records: list[dict], max_tokens: int | None = None) -> list[dict]:
    """One streamed chat request per prompt record."""
    from sot.prompts import to_messages

    bodies = []
    for record in records:
        body = {"model": model, "messages": to_messages(record), "max_tokens": max_tokens or args.max_tokens,
                "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if args.ignore_eos:
            body["ignore_eos"] = True
        bodies.append(body)
    return bodies


#: the untimed request each server answers before the runs (its first request pays for
#: start-up work: kernels, caches, the first pass)
WARMUP = {"prompt": "Say hello.", "max_tokens": 8}


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    urls = [u.rstrip("/") for u in args.url]
    labels = args.label or urls
    if len(labels) != len(urls):
        raise ConfigError("give one --label per --url")
    try:
        levels = [int(c) for c in args.concurrency.split(",")] if args.request_rate is None else [None]
    except ValueError:
        raise ConfigError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if any(c is not None and c < 1 for c in levels):
        raise ConfigError("concurrency levels must be >= 1")
    if len(set(levels)) < len(levels):
        raise ConfigError(f"--concurrency names a level twice ({args.concurrency}); --rounds repeats every level")
    keys = args.api_key or [None]
    if len(keys) not in (1, len(urls)):
        raise ConfigError("give one --api-key for every server, or one --api-key per --url")
    headers = {u: {"Authorization": f"Bearer {k}"} if k else {} for u, k in zip(urls, keys * len(urls))}
    out = Path(args.out) if args.out else None
    if out is not None:  # a bad folder is an error now, not after the whole run
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot make the folder ({exc.strerror})") from None
    slices = _prompt_slices(args, len(levels) * args.rounds)  # (one per level and round; every server the same)
    models = {u: args.model or _model_id(u, headers[u]) for u in urls}
    for url in urls:
        warm = _bodies(args, models[url], [{"prompt": WARMUP["prompt"]}], WARMUP["max_tokens"])
        asyncio.run(run_level(url, warm, headers[url], 1, None, args.timeout))  # (its figures are not kept)
    results: dict[tuple[str, str], LevelResult] = {}
    runs = [(lvl, r, u, lab) for lvl in levels for r in range(args.rounds) for u, lab in zip(urls, labels)]
    for level, r, url, label in tqdm(runs, desc="bench-serve", unit="run"):
        name = f"rate {args.request_rate}/s" if level is None else f"concurrency {level}"
        prompts = slices[levels.index(level) * args.rounds + r]
        wall, records = asyncio.run(run_level(url, _bodies(args, models[url], prompts), headers[url], level,
                                              args.request_rate, args.timeout))
        res = results.setdefault((label, name), LevelResult(label, name))
        res.wall_seconds += wall
        res.requests += records
        res.rss_mb = server_rss_mb(url)
    summaries = [r.summary() for r in results.values()]
    _print_table(summaries)
    if out is not None:
        payload = {"command": " ".join(sys.argv), "settings": {k: v for k, v in vars(args).items() if k != "api_key"},
                   "results": summaries,
                   "requests": {f"{k[0]} / {k[1]}": [asdict(r) for r in v.requests] for k, v in results.items()}}
        (out / "results.json").write_text(json.dumps(payload, indent=1))
        _plot(summaries, out / "bench-serve.png")
        print(f"wrote {out / 'results.json'} and {out / 'bench-serve.png'}", file=sys.stderr)
    errors = collections.Counter(r.error or "no reason given" for res in results.values() for r in res.requests
                                 if not r.ok)
    if errors:
        print(f"bench-serve: {sum(errors.values())} of {sum(s['requests'] for s in summaries)} requests failed; "
              "their figures are left out of the table:", file=sys.stderr)
        for error, count in errors.most_common(5):
            print(f"  {count} x {error}", file=sys.stderr)
        if len(errors) > 5:
            print(f"  ... and {len(errors) - 5} other errors" + (" (results.json has each)" if out else ""),
                  file=sys.stderr)
        return 1
    return 0


def _print_table(summaries: list[dict]) -> None:
    print("| server | load | tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | tau | RSS (MiB) | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        t, p = s["ttft_s"], s["tpot_s"]
        ms = [f"{v * 1000:.1f}" if v is not None else "-" for v in (p["p50"], p["p90"], p["p99"])]
        tau = f"{s['mean_tau']:.2f}" if s["mean_tau"] is not None else "-"
        ttft = " / ".join(f"{v}" if v is not None else "-" for v in (t["p50"], t["p90"], t["p99"]))
        print(f"| {s['label']} | {s['level']} | {s['throughput_tok_s']:.1f} | {ttft} | "
              f"{' / '.join(ms)} | {tau} | {s['server_rss_mb'] or '-'} | {s['ok']}/{s['requests']} |")


def _plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s["label"] for s in summaries))
    levels = list(dict.fromkeys(s["level"] for s in summaries))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        rows = {s["level"]: s for s in summaries if s["label"] == label}
        xs = [i + j * width for i in range(len(levels))]
        axes[0].bar(xs, [rows[lv]["throughput_tok_s"] if lv in rows else 0 for lv in levels], width, label=label)
        axes[1].bar(xs, [(rows[lv]["tpot_s"]["p50"] or 0) * 1000 if lv in rows else 0 for lv in levels], width,
                    label=label)
    for ax, title in zip(axes, ("throughput (generated tokens/s)", "median time per output token (ms)")):
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(levels))], levels)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
