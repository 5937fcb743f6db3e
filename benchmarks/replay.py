"""Replay a production trace against `ctxwarden serve`: throughput, latency, SLOs, tenants, memory.

The trace (Azure LLM inference 2023, conversation: arrival time, prompt and output tokens
per request) is far beyond two CPU cores, so it is scaled to this machine:

    lengths   prompt and output tokens x --length-scale (at least 1), prompts capped at
              --max-prompt-tokens; prompts are real text (Austen), token ids sent as is
    time      arrival gaps x --time-scale: chosen so the offered prompt-token rate is
              --load x the server's measured prefill rate (a short calibration first)

Each request streams (SSE) so its time to first token and time per output token are
measured on the client; tenants are the keys given (--keys), assigned round-robin, or
weighted by --tenant-weights. The server is started by this script (so its RSS can be
sampled once a second from /proc) unless --url points at a running one.

Outputs: benchmarks/results/replay[-TAG].json and .png (requests in flight, TTFT and TPOT
over time, the server's anonymous RSS, 429s). `--duration 1800` is the 30-minute soak: the
JSON then also has the RSS slope (MB per 1,000 requests, Theil-Sen with R^2), TTFT drift
adjusted for prompt length, leaked blocks after the run and errors by status.

Run:  .venv/bin/python benchmarks/replay.py --duration 120
      .venv/bin/python benchmarks/replay.py --duration 1800 --tag soak
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHARED = next((d / "shared" for d in (ROOT.parent, ROOT.parent.parent) if (d / "shared").is_dir()),
              ROOT.parent / "shared")
TRACE = SHARED / "traces" / "azure-llm-inference-2023-conv.csv"
CORPUS = SHARED / "corpora" / "austen"


@dataclass
class Outcome:
    """One replayed request as the client saw it."""

    index: int
    tenant: str
    sent_s: float  # since the start of the replay
    prompt_tokens: int
    max_tokens: int
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    total_s: float | None = None
    error: str | None = None


@dataclass
class Sample:
    """Once a second: the server's memory and what is in flight."""

    t_s: float
    rss_anon_mb: float | None
    in_flight: int
    completed: int


@dataclass
class Replay:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    in_flight: int = 0


# --- inputs ---------------------------------------------------------------------------------

def load_trace(path: Path, length_scale: float, max_prompt: int, max_output: int) -> list[tuple[float, int, int]]:
    """(arrival s from the first, prompt tokens, output tokens) per request, lengths scaled."""
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            t = datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp()
            rows.append((t, max(1, min(max_prompt, round(int(r["ContextTokens"]) * length_scale))),
                         max(1, min(max_output, round(int(r["GeneratedTokens"]) * length_scale)))))
    t0 = rows[0][0]
    return [(t - t0, p, o) for t, p, o in rows]


def corpus_tokens() -> list[int]:
    """Austen as SmolLM2 token ids: prompts are windows of real text."""
    from ctxwarden.context import load_tokenizer

    text = "".join(p.read_text() for p in sorted(CORPUS.glob("*.txt")))[:2_000_000]
    return load_tokenizer().encode(text)


# --- the server -----------------------------------------------------------------------------

def start_server(args, port: int, key_file: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ctxwarden", "serve", "--port", str(port), "--api-keys", str(key_file),
           "--kv-memory", args.kv_memory, "--log-level", "warning", *args.serve_args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(RESULTS / "replay-server.log", "w"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see benchmarks/results/replay-server.log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready in 180 s")


def rss_anon_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
          if line.startswith(("RssAnon", "VmSwap"))}
    return (kb.get("RssAnon", 0) + kb.get("VmSwap", 0)) / 1024


# --- the replay -----------------------------------------------------------------------------

async def one(client: httpx.AsyncClient, model: str, key: str, tenant: str, prompt: list[int],
              max_tokens: int, index: int, t0: float, state: Replay) -> None:
    out = Outcome(index, tenant, time.monotonic() - t0, len(prompt), max_tokens)
    state.outcomes.append(out)
    state.in_flight += 1
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent, first, last = time.monotonic(), None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode()[:200]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.status, out.error = 500, chunk["error"]["message"][:200]
                    return
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    now = time.monotonic()
                    first = first or now
                    last = now
                    out.output_tokens += 1
    except httpx.HTTPError as e:
        out.status, out.error = 599, f"{type(e).__name__}: {e}"[:200]
    finally:
        state.in_flight -= 1
        out.total_s = time.monotonic() - sent
        if first is not None:
            out.ttft_s = first - sent
            if out.output_tokens > 1:
                out.tpot_s = (last - first) / (out.output_tokens - 1)


async def sampler(state: Replay, pid: int | None, t0: float, stop: asyncio.Event, duration_s: float) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("replay"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("replay", total=duration_s, info="")
        while not stop.is_set():
            done = sum(o.status == 200 for o in state.outcomes if o.total_s is not None)
            sample = Sample(time.monotonic() - t0, rss_anon_mb(pid), state.in_flight, done)
            state.samples.append(sample)
            rss = f"{sample.rss_anon_mb:.0f} MB" if sample.rss_anon_mb is not None else "n/a"
            bar.update(task, completed=min(duration_s, sample.t_s),
                       info=f"sent {len(state.outcomes)}, done {done}, in flight {state.in_flight}, RssAnon {rss}")
            await asyncio.sleep(1.0)


async def replay(url: str, model: str, keys: list[tuple[str, str]], weights: list[float],
                 trace: list[tuple[float, int, int]], time_scale: float, duration_s: float,
                 tokens: list[int], pid: int | None) -> Replay:
    state, rng = Replay(), random.Random(0)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0, stop, tasks = time.monotonic(), asyncio.Event(), []
        monitor = asyncio.ensure_future(sampler(state, pid, t0, stop, duration_s))
        for i, (at, n_prompt, n_out) in enumerate(_looped(trace, duration_s / time_scale)):
            delay = at * time_scale - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            key, tenant = rng.choices(keys, weights)[0]
            start = rng.randrange(0, len(tokens) - n_prompt)
            tasks.append(asyncio.ensure_future(one(client, model, key, tenant, tokens[start:start + n_prompt],
                                                   n_out, i, t0, state)))
        await asyncio.gather(*tasks)
        stop.set()
        await monitor
    return state


def _looped(trace, span_s: float):
    """The trace, repeated end to end until `span_s` (trace seconds) is covered."""
    length = trace[-1][0] + 1.0
    k = 0
    while True:
        for at, p, o in trace:
            t = at + k * length
            if t > span_s:
                return
            yield t, p, o
        k += 1


# --- the numbers ----------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def summarize(state: Replay, args, elapsed_s: float, metrics_text: str) -> dict:
    ok = [o for o in state.outcomes if o.status == 200]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    slo_ok = [o for o in ok if o.ttft_s is not None and o.ttft_s <= args.slo_ttft
              and (o.tpot_s is None or o.tpot_s <= args.slo_tpot)]
    by_status: dict[str, int] = {}
    refused_by_tenant: dict[str, int] = {}
    for o in state.outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
        if o.status == 429:
            refused_by_tenant[o.tenant] = refused_by_tenant.get(o.tenant, 0) + 1
    out = {
        "requests": len(state.outcomes), "completed": len(ok), "elapsed_s": elapsed_s,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / elapsed_s,
        "prompt_tokens_per_s": sum(o.prompt_tokens for o in ok) / elapsed_s,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "tpot_s": {f"p{q}": pct(tpot, q) for q in (50, 90, 99)},
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot,
                "attainment": len(slo_ok) / max(1, len(state.outcomes))},
        "status": by_status, "refused_by_tenant": refused_by_tenant,
        "leaked_blocks": _metric(metrics_text, "ctxwarden_kv_leaked_blocks"),
        "blocks_in_use_after": _metric(metrics_text, "ctxwarden_kv_blocks_in_use"),
    }
    out["memory"] = memory_trend(state)
    out["ttft_drift"] = ttft_drift(ok)
    return out


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def memory_trend(state: Replay) -> dict:
    """RSS against completed requests after a warm-up (the first fifth of the run), by the
    diagnostics' own robust fit (Theil-Sen with its 95% interval)."""
    from ctxwarden.diagnostics.leaks import robust_slope

    pts = [(s.completed, s.rss_anon_mb) for s in state.samples if s.rss_anon_mb is not None]
    pts = pts[len(pts) // 5:]
    if len(pts) < 10 or pts[-1][0] == pts[0][0]:
        return {"note": "too few samples for a trend"}
    fit = robust_slope([float(c) for c, _ in pts], [m for _, m in pts])
    return {"rss_anon_mb_start": pts[0][1], "rss_anon_mb_end": pts[-1][1],
            "rss_anon_mb_max": max(m for _, m in pts),
            "slope_mb_per_1000_requests": fit.slope * 1000,
            "slope_interval_mb_per_1000_requests": [fit.slope_low * 1000, fit.slope_high * 1000],
            "r2": fit.r_squared, "num_samples": fit.num_samples,
            "completed_from": pts[0][0], "completed_to": pts[-1][0]}


def ttft_drift(ok: list[Outcome]) -> dict:
    """TTFT change per 1,000 completed requests at a fixed prompt length (the diagnostics'
    Huber regression on prompt length, its square and the completed count; bootstrap
    interval). Each request is placed at the count completed when it finished."""
    from ctxwarden.diagnostics.leaks import ttft_drift as fit_drift

    done = sorted((o for o in ok if o.ttft_s is not None), key=lambda o: o.sent_s + (o.total_s or 0.0))
    if len(done) < 20:
        return {"note": "too few requests"}
    fit = fit_drift(list(range(len(done))), [o.prompt_tokens for o in done], [o.ttft_s for o in done])
    return {"seconds_per_1000_requests": fit.seconds_per_1000_requests,
            "interval": [fit.low, fit.high], "contains_zero": fit.contains_zero,
            "median_ttft_s": fit.median_ttft_s, "num_requests": fit.num_samples}


def plot(state: Replay, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    t = [s.t_s for s in state.samples]
    axes[0].plot(t, [s.in_flight for s in state.samples], color="tab:blue")
    axes[0].set_ylabel("requests in flight")
    ok = [o for o in state.outcomes if o.status == 200 and o.ttft_s is not None]
    axes[1].scatter([o.sent_s for o in ok], [o.ttft_s for o in ok], s=4, color="tab:orange")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_yscale("log")
    tp = [o for o in ok if o.tpot_s is not None]
    axes[2].scatter([o.sent_s for o in tp], [o.tpot_s * 1000 for o in tp], s=4, color="tab:green")
    axes[2].set_ylabel("time per output token (ms)")
    axes[3].plot(t, [s.rss_anon_mb for s in state.samples], color="tab:red", label="server RssAnon + swap")
    refused = [o.sent_s for o in state.outcomes if o.status == 429]
    for x in refused:
        axes[3].axvline(x, color="grey", alpha=0.2, lw=0.5)
    axes[3].set_ylabel("MB (grey: 429s)")
    axes[3].set_xlabel("seconds since start")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main -------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--keys", default="key-a:tenant-a,key-b:tenant-b,key-c:tenant-c",
                   help="KEY:TENANT,... (a key file is written when this script starts the server)")
    p.add_argument("--tenant-weights", default="3,1,1", help="share of the traffic per key")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of replay")
    p.add_argument("--length-scale", type=float, default=0.125)
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--load", type=float, default=0.7, help="offered prompt tokens / measured prefill rate")
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.25)
    p.add_argument("--tag", default="")
    p.add_argument("serve_args", nargs="*", help="after --: more `ctxwarden serve` flags")
    return p.parse_args(argv)


def calibrate(url: str, model: str, key: str, tokens: list[int]) -> float:
    """The server's prefill rate (tokens/s): one 1,024-token prompt, 1 new token, best of 2."""
    best = 0.0
    for k in range(2):
        t = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=600, headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "prompt": tokens[k * 2048:k * 2048 + 1024], "max_tokens": 1})
        r.raise_for_status()
        best = max(best, 1024 / (time.monotonic() - t))
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    keys = [tuple(kt.split(":", 1)) for kt in args.keys.split(",")]
    weights = [float(w) for w in args.tenant_weights.split(",")][:len(keys)]
    trace = load_trace(args.trace, args.length_scale, args.max_prompt_tokens, args.max_output_tokens)
    tokens = corpus_tokens()
    proc, url = None, args.url
    if url is None:
        key_file = Path(tempfile.mkdtemp()) / "keys.txt"
        key_file.write_text("".join(f"{k} {t}\n" for k, t in keys))
        key_file.chmod(0o600)
        port = _free_port()
        proc, url = start_server(args, port, key_file), f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {keys[0][0]}"}, timeout=10).json()["data"][0]["id"]
        rate = calibrate(url, model, keys[0][0], tokens)
        offered = sum(p for _, p, _ in trace) / (trace[-1][0] + 1.0)  # prompt tokens per trace second
        time_scale = offered / (args.load * rate)
        print(f"prefill {rate:.0f} tok/s; trace offers {offered:.0f} prompt tok/s; time x {time_scale:.2f}", flush=True)
        started = time.monotonic()
        state = asyncio.run(replay(url, model, keys, weights, trace, time_scale, args.duration, tokens,
                                   proc.pid if proc else None))
        elapsed = time.monotonic() - started
        time.sleep(1.5)  # the idle audit and the published snapshot settle
        metrics_text = httpx.get(url + "/metrics", timeout=10).text
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary = summarize(state, args, elapsed, metrics_text)
    summary.update(machine=_machine(), prefill_tokens_per_s=rate, time_scale=time_scale, args=vars(args) | {"trace": str(args.trace)})
    name = "replay" + (f"-{args.tag}" if args.tag else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(state, RESULTS / f"{name}.png", f"replay of {args.trace.name}: {summary['requests']} requests, "
         f"load {args.load}, {_machine()['cpu']}")
    print(json.dumps({k: summary[k] for k in ("requests", "completed", "ttft_s", "tpot_s", "slo", "status",
                                              "refused_by_tenant", "leaked_blocks", "memory", "ttft_drift")}, indent=2))
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "when": time.strftime("%Y-%m-%d %H:%M"),
            "load_average": list(os.getloadavg())}


if __name__ == "__main__":
    sys.exit(main())
