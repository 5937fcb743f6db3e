"""KV tiers on SmolLM2-135M-Instruct: cold vs warm TTFT from the pool, RAM, disk and Redis.

All in one run, side by side, on the same prompts (the package's shipped Austen text):

- per prompt size (1K / 4K / 8K tokens): TTFT cold (nothing cached), then warm with the
  prefix in the pool, in the RAM tier, on disk, in Redis (each after Engine.reset_prefix_cache,
  so the pool has nothing), and on a second engine (another replica) through Redis; every
  warm run's first token is checked against the cold run's
- bytes moved and GB/s per tier, and the share of warm TTFT spent verifying values
- the cost model on a slowed Redis link (a loopback TCP proxy adding latency and capping
  bandwidth): fetch-only vs recompute-only vs the cost model's choice, and what it chose

Redis is a real redis-server started here (maxmemory, allkeys-lru, no persistence).
Results: benchmarks/results/kv_tiers.json and .png. Run:
    .venv/bin/python benchmarks/kv_tiers.py [--sizes 1000 4000 8000] [--reps 3] [--quick]
Never part of `make test`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEXT = ROOT / "src" / "ctxwarden" / "models" / "data" / "tokenizer_text.txt.gz"
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, fp32 KV (the planner's figure)
COST_TOKENS = 2000  # the prefix of the slowed-link runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(maxmemory: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
                             "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


class SlowLink:
    """A loopback TCP proxy to Redis that delays each request and caps reply bandwidth."""

    def __init__(self, target_port: int, latency_s: float, bytes_per_s: float):
        import asyncio

        self.port, self.latency_s, self.bytes_per_s = free_port(), latency_s, bytes_per_s
        self._loop = asyncio.new_event_loop()
        self._target = target_port
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self):
        import asyncio

        async def pipe(reader, writer, delay_s, bps):
            try:
                while chunk := await reader.read(65536):
                    await asyncio.sleep(delay_s + (len(chunk) / bps if bps else 0))
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            writer.close()

        async def handle(client_r, client_w):
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self._target)
            asyncio.ensure_future(pipe(client_r, server_w, self.latency_s, 0))
            asyncio.ensure_future(pipe(server_r, client_w, 0, self.bytes_per_s))

        self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)

    def close(self):
        self._loop.call_soon_threadsafe(self._server.close)


def prompt_ids(num_tokens: int, offset: int) -> list[int]:
    """`num_tokens` token ids of the shipped text from character `offset` (SmolLM2's tokenizer)."""
    from ctxwarden.context.tokenizers import load_tokenizer
    from ctxwarden.spec.checkpoint import resolve_checkpoint

    tokenizer = load_tokenizer(resolve_checkpoint(None).path)
    text = gzip.open(TEXT, "rt", encoding="utf-8").read()
    ids = tokenizer.encode(text[offset:offset + num_tokens * 8])
    assert len(ids) >= num_tokens, f"the shipped text gave {len(ids)} tokens, fewer than {num_tokens}"
    return ids[:num_tokens]


def engine(tiers: str | None, num_tokens: int, fetch: str = "auto"):
    from ctxwarden.llm import LLM

    kv_memory = int((num_tokens + 512) * KV_BYTES_PER_TOKEN * 1.1)
    return LLM(kv_memory=kv_memory, kv_tiers=tiers, kv_tier_fetch=fetch)


def ttft(llm, ids) -> tuple[float, int, int]:
    """(time to first token, the token, prompt tokens served by a cache or tier)."""
    from ctxwarden.sampling import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return out.time_to_first_token_s, out.token_ids[0], out.num_cached_tokens


def tier_delta(llm, name: str, before: dict | None) -> dict:
    t = next(s for s in llm.engine.stats().tiers if s.tier == name)
    now = {"bytes_out": t.bytes_out, "fetch_s": t.fetch_seconds_sum, "verify_s": t.verify_seconds_sum}
    return now if before is None else {k: now[k] - before[k] for k in now}


def warm_runs(llm, ids, tier: str | None, reps: int, cold_token: int, reset: bool) -> dict:
    """`reps` warm TTFTs (after a pool reset when `reset`), with the tier's bytes and times."""
    times, before = [], tier_delta(llm, tier, None) if tier else None
    for _ in range(reps):
        if reset:
            llm.engine.reset_prefix_cache()
        t, token, cached = ttft(llm, ids)
        assert token == cold_token, f"warm first token {token} != cold {cold_token} ({tier})"
        assert cached >= len(ids) - 16, f"{tier}: only {cached} of {len(ids)} tokens were warm"
        times.append(t)
    out = {"ttft_s": times}
    if tier:
        d = tier_delta(llm, tier, before)
        out.update(bytes_moved=d["bytes_out"], gb_per_s=d["bytes_out"] / d["fetch_s"] / 1e9 if d["fetch_s"] else None,
                   verify_s=d["verify_s"] / reps)
    return out


def measure_tier(n: int, tier: str, reps: int, redis_url: str, workdir: str) -> dict:
    """One fresh engine with one tier: cold TTFT (computes and stores), then warm ones."""
    ids = prompt_ids(n, offset=7 * n)
    ram_bytes = int(n * KV_BYTES_PER_TOKEN * 1.5)
    tiers = {"ram": f"ram:{ram_bytes}", "disk": f"disk:{Path(workdir) / f'disk-{n}'}:{2 * ram_bytes}",
             "redis": redis_url}[tier]
    llm = engine(tiers, n)
    cold, token, _ = ttft(llm, ids)
    llm.engine.tiers.flush(300)
    row = {"cold_ttft_s": cold, "cold_token": token}
    if tier == "ram":
        row["pool"] = warm_runs(llm, ids, None, reps, token, reset=False)
    row[tier] = warm_runs(llm, ids, tier, reps, token, reset=True)
    llm.close()
    return row


def measure_replica(n: int, redis_url: str, cold_token: int) -> dict:
    """A second engine in its own process: its pool never saw the prompt another computed."""
    llm = engine(redis_url, n)
    return warm_runs(llm, prompt_ids(n, offset=7 * n), "redis", 1, cold_token, reset=False)


def measure_size(n: int, reps: int, redis_url: str, workdir: Path) -> dict:
    """Every tier for one prompt size, each engine in a fresh child process."""
    row: dict = {"tokens": n, "cold_ttft_s": []}
    for tier in ("ram", "disk", "redis"):
        got = run_child({"kind": "tier", "n": n, "tier": tier, "reps": reps, "redis_url": redis_url,
                         "workdir": str(workdir)})
        row["cold_ttft_s"].append(got.pop("cold_ttft_s"))
        token = got.pop("cold_token")
        assert row.setdefault("cold_token", token) == token, "cold runs disagree"
        row.update(got)
    row["second_replica"] = run_child({"kind": "replica", "n": n, "redis_url": redis_url,
                                       "cold_token": row["cold_token"]})
    return row


def run_child(task: dict) -> dict:
    """Run one measurement in a fresh process (its memory is its own, freed at exit)."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(task)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child {task['kind']} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(task: dict) -> dict:
    """What one child process measures."""
    kind = task["kind"]
    if kind == "tier":
        return measure_tier(task["n"], task["tier"], task["reps"], task["redis_url"], task["workdir"])
    if kind == "replica":
        return measure_replica(task["n"], task["redis_url"], task["cold_token"])
    if kind == "cost_writer":
        llm = engine(task["redis_url"], COST_TOKENS)
        _, token, _ = ttft(llm, prompt_ids(COST_TOKENS, offset=3))
        llm.engine.tiers.flush(300)
        llm.close()
        return {"cold_token": token}
    if kind == "cost_recompute":
        return _policy_runs(None, "auto", task["reps"], task["cold_token"])
    link = SlowLink(task["port"], task["latency_ms"] / 1000, task["mb_per_s"] * 1e6)
    return _policy_runs(f"redis://127.0.0.1:{link.port}?timeout_ms=2000", task["policy"], task["reps"],
                        task["cold_token"])


def cost_model_runs(port: int, reps: int) -> dict:
    """A 2K prefix in Redis, read over links of falling bandwidth: fetch-only, recompute-only, chosen."""
    token = run_child({"kind": "cost_writer", "redis_url": f"redis://127.0.0.1:{port}"})["cold_token"]
    recompute = run_child({"kind": "cost_recompute", "reps": reps, "cold_token": token})
    rows = []
    for latency_ms, mb_per_s in ((0.5, 1000), (2, 100), (5, 10)):
        row = {"latency_ms": latency_ms, "mb_per_s": mb_per_s, "recompute_only": recompute}
        for policy in ("always", "auto"):
            row[policy] = run_child({"kind": "cost_link", "port": port, "latency_ms": latency_ms,
                                     "mb_per_s": mb_per_s, "policy": policy, "reps": reps, "cold_token": token})
        rows.append(row)
    return {"prefix_tokens": COST_TOKENS, "scenarios": rows}


def _policy_runs(url: str | None, policy: str, reps: int, cold_token: int) -> dict:
    """`reps` TTFTs through one link under one policy (None: no tier), and what was decided."""
    ids = prompt_ids(COST_TOKENS, offset=3)
    llm = engine(url, COST_TOKENS, fetch=policy)
    times, after_each = [], []
    for _ in range(reps):
        llm.engine.reset_prefix_cache()
        t, token, cached = ttft(llm, ids)
        assert token == cold_token
        stats = next((s for s in llm.engine.stats().tiers if s.tier == "redis"), None)
        after_each.append({"cached_tokens": cached, "decisions_so_far": dict(stats.decisions) if stats else {}})
        times.append(t)
    llm.close()
    return {"ttft_s": times, "after_each": after_each}


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        cold = statistics.median(r["cold_ttft_s"])
        s = {"tokens": r["tokens"], "cold": _stats(r["cold_ttft_s"])}
        for src in ("pool", "ram", "disk", "redis", "second_replica"):
            med = statistics.median(r[src]["ttft_s"])
            s[src] = {**_stats(r[src]["ttft_s"]), "ratio_to_cold": med / cold}
            if "verify_s" in r[src]:
                s[src].update(verify_share=r[src]["verify_s"] / med, gb_per_s=r[src]["gb_per_s"],
                              bytes_moved=r[src]["bytes_moved"])
        out.append(s)
    return out


def plot(summary: list[dict], cost: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if cost else 1, figsize=(13 if cost else 7, 4.8), squeeze=False)
    a = axes[0][0]
    sources = ("cold", "pool", "ram", "disk", "redis", "second_replica")
    width = 0.13
    for i, src in enumerate(sources):
        xs = [k + i * width for k in range(len(summary))]
        ys = [row[src]["median"] for row in summary]
        a.bar(xs, ys, width, label=src.replace("_", " "))
        for x, row in zip(xs, summary):
            if src != "cold":
                a.text(x, row[src]["median"], f"{row[src]['ratio_to_cold']:.2f}x", ha="center", va="bottom",
                       fontsize=6, rotation=90)
    a.set_xticks([k + 2.5 * width for k in range(len(summary))], [f"{r['tokens']} tokens" for r in summary])
    a.set_yscale("log")
    a.set_ylabel("time to first token, s (median; log)")
    a.set_title("SmolLM2-135M fp32: cold vs warm prefix (ratio to cold)")
    a.legend(fontsize=7)
    if cost:
        _plot_cost(axes[0][1], cost)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_cost(b, cost: dict) -> None:
    rows = cost["scenarios"]
    for i, (key, name) in enumerate((("always", "fetch only"), ("recompute_only", "recompute only"),
                                     ("auto", "cost model"))):
        ys = [statistics.median(c[key]["ttft_s"]) for c in rows]
        b.bar([k + i * 0.27 for k in range(len(rows))], ys, 0.27, label=name)
    b.set_xticks([k + 0.27 for k in range(len(rows))], [f"+{c['latency_ms']} ms\n{c['mb_per_s']} MB/s" for c in rows])
    b.set_ylabel("time to first token, s (median)")
    b.set_title(f"{cost['prefix_tokens']}-token prefix over a slowed Redis link")
    b.legend(fontsize=8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 8000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one small size, two reps (a smoke run)")
    p.add_argument("--skip-cost", action="store_true", help="leave out the slowed-link runs")
    p.add_argument("--only-cost", action="store_true",
                   help="rerun the slowed-link runs only, keeping the sizes' results in the JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, as JSON (run by the parent)
    args = p.parse_args()
    if args.child:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.quick:
        args.sizes, args.reps = [1000], 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    redis, port = start_redis("4gb")
    workdir = Path(tempfile.mkdtemp(prefix="kv-tiers-bench-"))
    try:
        rows = []
        for n in [] if args.only_cost else args.sizes:
            print(f"[kv_tiers] {n} tokens ...", file=sys.stderr, flush=True)
            rows.append(measure_size(n, args.reps, f"redis://127.0.0.1:{port}", workdir))
        cost = None if args.skip_cost else cost_model_runs(port, args.reps)
    finally:
        redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.only_cost:
        rows = json.loads((RESULTS / "kv_tiers.json").read_text())["runs"]
    summary = summarise(rows)
    machine = {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
               "platform": platform.platform(), "torch": torch.__version__,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "date": time.strftime("%Y-%m-%d"),
               "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_tiers.json").write_text(json.dumps(
        {"machine": machine, "summary": summary, "runs": rows, "cost_model": cost}, indent=1))
    plot(summary, cost, RESULTS / "kv_tiers.png")
    for s in summary:
        print(f"{s['tokens']:>5} tokens: cold {s['cold']['median']:.2f} s; " + ", ".join(
            f"{k} {s[k]['ratio_to_cold']:.3f}x" for k in ("pool", "ram", "disk", "redis", "second_replica")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
