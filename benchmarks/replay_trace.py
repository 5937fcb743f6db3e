"""Replay the Azure 2023 conversation trace against `ctxwarden serve`, then check SLO risk.

The trace (19,366 requests, one hour; shared/traces/) is scaled to this machine: prompt and
output lengths are multiplied by --prompt-scale / --output-scale (and capped to the window),
arrivals are compressed so the run offers --rate requests per second, keeping the trace's
burstiness. Each request is a /v1/completions call with random token ids of the scaled
length (so the prefix cache cannot help), `ignore_eos` (so it produces exactly the scaled
output length), streamed with the official openai client; TTFT and TPOT are measured on the
client side. The client writes the request log in ctxwarden's format (docs/diagnostics.md).

Then the held-out check of issue 14: requests alternate between a fit half and a held-out
half (both see the same load over time); the latency model fitted on the first half
predicts P(TTFT > SLO) per prompt-length bucket for the second half's lengths, and each
prediction is compared with the held-out half's measured Wilson interval.

Run: .venv/bin/python benchmarks/replay_trace.py [--requests 240] [--rate 0.8] [--ttft 1.5s]
Writes benchmarks/results/replay_trace.{jsonl,json,md,png}. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# shared/ sits beside the checkout (CI, the main checkout) or one level further up (a worktree)
TRACE = next((d / "shared" / "traces" / "azure-llm-inference-2023-conv.csv" for d in (ROOT.parent, ROOT.parent.parent)
              if (d / "shared" / "traces").is_dir()), ROOT.parent / "shared" / "traces" / "azure-llm-inference-2023-conv.csv")


def load_trace(path: Path, num_requests: int, start: int) -> list[tuple[float, int, int]]:
    """(seconds since the first request, prompt tokens, output tokens) for a slice of the trace."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    rows = rows[start:start + num_requests]
    t0 = rows[0][0]
    return [(t - t0, p, g) for t, p, g in rows]


def scale_trace(rows, prompt_scale: float, output_scale: float, rate: float, window: int, max_output: int):
    """Scaled arrivals (offered `rate` req/s on average) and lengths that fit the window."""
    span = rows[-1][0] or 1.0
    time_scale = (len(rows) / rate) / span
    out = []
    for t, p, g in rows:
        gen = int(min(max(1, round(g * output_scale)), max_output))
        prompt = int(min(max(1, round(p * prompt_scale)), window - gen))
        out.append((t * time_scale, prompt, gen))
    return out


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, kv_memory: str, extra_args: tuple = ()) -> subprocess.Popen:
    """`ctxwarden serve` (plus `extra_args`) in a child process; returns once /health answers 200."""
    import httpx

    cmd = [sys.executable, "-m", "ctxwarden", "serve", "--port", str(port), "--kv-memory", kv_memory,
           "--log-level", "warning"] + (["--model", model] if model else []) + list(extra_args)
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in 300 s")


async def one_request(client, model: str, index: int, delay_s: float, prompt_tokens: int, output_tokens: int,
                      vocab: int, t0: float) -> dict:
    """Wait for the arrival time, stream one completion, return its request-log record."""
    await asyncio.sleep(max(0.0, t0 + delay_s - time.perf_counter()))
    ids = np.random.default_rng(index).integers(100, vocab - 100, prompt_tokens).tolist()
    sent, first, last, usage, status = time.perf_counter(), None, None, None, "ok"
    arrival = time.time()
    try:
        stream = await client.completions.create(model=model, prompt=ids, max_tokens=output_tokens, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                first = first or now
                last = now
            if chunk.usage:
                usage = chunk.usage
    except Exception:  # noqa: BLE001  (any failure is an "error" record: the SLO was missed)
        status = "error"
    completion = usage.completion_tokens if usage else 0
    cached = (usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0) or 0
    return {"time": arrival, "request_id": f"replay-{index}", "tenant": None,
            "prompt_tokens": usage.prompt_tokens if usage else prompt_tokens, "completion_tokens": completion,
            "cached_tokens": cached, "ttft_s": (first - sent) if first else None,
            "tpot_s": (last - first) / (completion - 1) if first and completion > 1 else None, "status": status}


async def replay(port: int, model: str, rows, vocab: int) -> list[dict]:
    """Every request at its scaled arrival time, concurrently, with a progress bar."""
    from openai import AsyncOpenAI
    from rich.progress import Progress

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one_request(client, model, i, t, p, g, vocab, t0)) for i, (t, p, g) in enumerate(rows)]
    with Progress() as bar:
        job = bar.add_task("requests", total=len(tasks))
        for done in asyncio.as_completed(tasks):
            await done
            bar.advance(job)
    return [t.result() for t in tasks]


def held_out_check(records, ttft_s: float, edges) -> dict:
    """Fit on even requests, predict the odd ones' buckets, compare with their Wilson intervals."""
    from ctxwarden.diagnostics.request_log import RequestRecord
    from ctxwarden.diagnostics.slo import SLO, fit_latency_model, measure_risk, predict_risk

    recs = [RequestRecord(**r) for r in records]
    fit, held = recs[0::2], recs[1::2]
    slo = SLO(ttft_s)
    model = fit_latency_model(fit)
    measured = measure_risk(held, slo, edges)
    predicted = predict_risk(model, [r.prompt_tokens for r in held], slo, edges,
                             computed_tokens=[r.computed_prompt_tokens for r in held])
    pred = {b.lo_tokens: b for b in predicted.buckets}
    rows = [{"bucket": f"{m.lo_tokens}-{m.hi_tokens - 1}", "num_requests": m.num_requests,
             "measured": m.p_violation, "low": m.p_low, "high": m.p_high,
             "predicted": pred[m.lo_tokens].p_violation,
             "inside": m.p_low <= pred[m.lo_tokens].p_violation <= m.p_high} for m in measured.buckets]
    return {"slo_ttft_s": ttft_s, "latency_model": model.to_dict(), "buckets": rows,
            "num_inside": sum(r["inside"] for r in rows), "num_buckets": len(rows),
            "measured": measured, "predicted": predicted}


def write_results(records, check, args, wall_s: float) -> None:
    """The request log, a JSON summary, a Markdown table and the SLO-risk PNG."""
    from ctxwarden.diagnostics.plots import plot_slo_risk

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "replay_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from ctxwarden.diagnostics.environment import read_cpu

    run_args = {**vars(args), "trace": os.path.relpath(args.trace, ROOT)}
    summary = {"machine": f"{read_cpu()['model'] or platform.machine()}, {os.cpu_count()} CPUs",
               "load_average": {"start": args.load_start, "end": os.getloadavg()},
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "args": run_args,
               "wall_s": wall_s, "num_errors": sum(r["status"] != "ok" for r in records),
               **{k: v for k, v in check.items() if k not in ("measured", "predicted")}}
    (RESULTS / "replay_trace.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# Replay of the Azure 2023 conversation trace ({len(records)} requests, TTFT SLO {args.ttft})", "",
             "| prompt tokens | held-out requests | measured P(TTFT > SLO) | 95% Wilson | predicted | inside |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['bucket']} | {r['num_requests']} | {r['measured']:.3f} | {r['low']:.3f}-{r['high']:.3f} | "
              f"{r['predicted']:.3f} | {'yes' if r['inside'] else 'no'} |" for r in check["buckets"]]
    (RESULTS / "replay_trace.md").write_text("\n".join(lines) + "\n")
    plot_slo_risk(check["measured"], check["predicted"], str(RESULTS / "replay_trace.png"))


def main() -> int:
    """Parse, start the server, replay, check, write."""
    from ctxwarden.cli.diag._args import parse_duration_s

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--model", default=None, help="HF dir or .gguf (default SmolLM2-135M-Instruct)")
    p.add_argument("--served-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--start", type=int, default=0, help="first trace row to replay")
    p.add_argument("--rate", type=float, default=0.8, help="offered requests per second")
    p.add_argument("--prompt-scale", type=float, default=0.25)
    p.add_argument("--output-scale", type=float, default=0.05)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--ttft", default="1.5s")
    p.add_argument("--buckets", default="0,128,256,512,1024,4096")
    args = p.parse_args()
    args.load_start = os.getloadavg()  # the machine may be shared: the load says how much
    rows = scale_trace(load_trace(Path(args.trace), args.requests, args.start), args.prompt_scale,
                       args.output_scale, args.rate, args.window, args.max_output)
    port = free_port()
    server = start_server(args.model, port, args.kv_memory)
    try:
        start = time.perf_counter()
        records = asyncio.run(replay(port, args.served_name, rows, args.vocab))
        wall_s = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    edges = tuple(int(v) for v in args.buckets.split(","))
    check = held_out_check(records, parse_duration_s(args.ttft), edges)
    write_results(records, check, args, wall_s)
    print((RESULTS / "replay_trace.md").read_text())
    print(f"{check['num_inside']} of {check['num_buckets']} buckets: prediction inside the measured interval; "
          f"wall {wall_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
