"""Steady-state memory of `make serve` and what it is made of (issue 17).

Starts `ctxwarden serve` exactly as `make serve` does (SmolLM2, the default 2 GiB KV pool,
default weights), then replays issue 17's load: non-streaming chat requests of Emma
excerpts (900-2,700 characters), 32 new tokens, 8 at a time. Reads RssAnon of the server
pid at idle and after every 40 requests. The parts: the interpreter with torch and the
server imported (a separate process), the weights the runner holds, the KV pages touched
(the pool is mapped on first touch), and the rest (oneDNN primitives, allocator, Python).

After the load it waits until the engine has trimmed its heap (engine/heap.py, counted on
/metrics) and reads RssAnon at rest again: that is the steady state. Writes
benchmarks/results/serve_memory.{json,png}.

Run: .venv/bin/python benchmarks/serve_memory.py [--requests 240]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

    llm = LLM()  # the defaults `make serve` runs with
    return {"weights_mb": llm.engine.runner.model.weights_bytes / 2**20,
            "kv_pool_mb": llm.engine.runner.kv_cache.nbytes / 2**20,
            "page_mb": llm.engine.runner.layout.page_bytes / 2**20,
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


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def rest_reading(proc: subprocess.Popen, url: str, trims_before: float) -> float:
    """RssAnon once the idle engine has trimmed its heap (or after 60 s without a trim)."""
    deadline = time.monotonic() + 60
    while metric(url, "ctxwarden_heap_trims_total") <= trims_before and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    return rss_anon_mb(proc.pid)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    done, mb = zip(*result["readings_mb"])
    ax.plot(done, mb, "o-", label="RssAnon after each batch of 40")
    rest_x, rest_y = zip(*result["rest_readings_mb"])
    ax.plot(rest_x, rest_y, "s", label="RssAnon at rest (after the idle heap trim)")
    parts = (("baseline_mb", "interpreter + torch + server"), ("weights_mb", "+ weights"),
             ("kv_touched_mb", "+ KV pages touched"))
    level = 0.0
    for key, label in parts:
        level += result[key]
        ax.axhline(level, ls="--", lw=0.8, color="grey")
        ax.text(done[-1], level, label, ha="right", va="bottom", fontsize=8)
    ax.set_xlabel("requests completed")
    ax.set_ylabel("MB")
    ax.set_title(f"make serve memory under issue 17's load ({result['machine']['cpu']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=240)
    args = ap.parse_args()
    from ctxwarden.cli.bench_run import corpus_text

    text, rng = corpus_text(), random.Random(17)
    from rich.progress import Progress

    proc, url = start_server()
    readings = [(0, rss_anon_mb(proc.pid))]
    rest = []

    def one(_):
        start = rng.randrange(0, len(text) - 3000)
        excerpt = text[start:start + rng.randrange(900, 2700)]
        r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "Summarise:\n" + excerpt}]})
        r.raise_for_status()

    try:
        with ThreadPoolExecutor(8) as pool, Progress() as progress:
            task = progress.add_task("requests", total=args.requests)
            for done in range(40, args.requests + 1, 40):
                trims = metric(url, "ctxwarden_heap_trims_total")
                list(pool.map(one, range(40)))
                readings.append((done, rss_anon_mb(proc.pid)))
                rest.append((done, rest_reading(proc, url, trims)))
                progress.update(task, advance=40, description=f"RssAnon {readings[-1][1]:.0f} MB, "
                                                              f"at rest {rest[-1][1]:.0f} MB")
        # KV pages the pool has touched (mapped on first write): blocks in use or holding
        # prefix-cache content; freed partial blocks are not counted (a lower bound)
        kv_blocks = metric(url, "ctxwarden_kv_blocks_in_use") + metric(url, "ctxwarden_kv_blocks_cached")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"readings_mb": readings, "rest_readings_mb": rest, "baseline_mb": baseline_mb(), **components(),
              "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "load_average_end": list(os.getloadavg()),
                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")},
              "date": time.strftime("%Y-%m-%d %H:%M")}
    result["kv_blocks_touched"] = kv_blocks
    result["kv_touched_mb"] = kv_blocks * result["page_mb"]
    steady = rest[-1][1] if rest else readings[-1][1]
    result["rest_mb"] = steady
    result["other_mb"] = steady - result["baseline_mb"] - result["weights_mb"] - result.get("kv_touched_mb", 0.0)
    out = ROOT / "benchmarks" / "results" / "serve_memory"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
