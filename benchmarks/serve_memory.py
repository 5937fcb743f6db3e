"""Steady-state memory of `make serve` and what it is made of (issue 17).

Starts `ctxwarden serve` exactly as `make serve` does (SmolLM2, --kv-memory 1GiB default,
default weights), then replays issue 17's load: non-streaming chat requests of Emma
excerpts (900-2,700 characters), 32 new tokens, 8 at a time. Reads RssAnon of the server
pid at idle and after every 40 requests. The parts: the interpreter with torch and the
server imported (a separate process), the weights the runner holds, the KV pages touched
(the pool is mapped on first touch), and the rest (oneDNN primitives, allocator, Python).

Run: .venv/bin/python benchmarks/serve_memory.py [--requests 240]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def rss_anon_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def baseline_mb() -> float:
    """RssAnon of an interpreter that imported torch and the server, without a model."""
    code = ("import torch, ctxwarden.server.app, pathlib; print([l for l in pathlib.Path("
            "'/proc/self/status').read_text().splitlines() if l.startswith('RssAnon')][0].split()[1])")
    return int(subprocess.check_output([sys.executable, "-c", code], text=True)) / 1024


def components() -> dict:
    """Weights held and the KV pool's size, from the runner itself (in this process)."""
    from ctxwarden import LLM

    llm = LLM(kv_memory="1GiB")
    return {"weights_mb": llm.engine.runner.model.weights_bytes / 2**20,
            "kv_pool_mb": llm.engine.runner.kv_cache.nbytes / 2**20,
            "weights_mode": llm.engine.config.weights}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ctxwarden", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=240)
    args = ap.parse_args()
    from ctxwarden.cli.bench_run import corpus_text

    text, rng = corpus_text(), random.Random(17)
    proc, url = start_server()
    readings = [(0, rss_anon_mb(proc.pid))]

    def one(_):
        start = rng.randrange(0, len(text) - 3000)
        excerpt = text[start:start + rng.randrange(900, 2700)]
        r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "Summarise:\n" + excerpt}]})
        r.raise_for_status()

    try:
        with ThreadPoolExecutor(8) as pool:
            for done in range(40, args.requests + 1, 40):
                list(pool.map(one, range(40)))
                readings.append((done, rss_anon_mb(proc.pid)))
                print(f"{done} requests: RssAnon {readings[-1][1]:.0f} MB", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"readings_mb": readings, "baseline_mb": baseline_mb(), **components(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    (ROOT / "benchmarks" / "results" / "serve_memory.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
