"""Regenerate docs/diagnostics.md's real outputs and figures on SmolLM2, end to end.

Starts `ctxwarden serve` (the default model, SmolLM2-135M-Instruct) with a request log, a
crash directory and every request's attention monitored; sends chat requests built from
Austen passages of varied length (some sharing a prefix, so the prefix cache is used);
then reads the slow-leak slope off /metrics (warm-up 0, so the first requests count) and runs,
against that server and its log:

    ctxwarden diag mem snapshot --url URL
    ctxwarden doctor --url URL
    ctxwarden diag timeline --url URL --png docs/img/diag-timeline.png
    GET /debug/attention/{request_id}                 (one live request's record)
    ctxwarden diag attention PROMPT --png docs/img/diag-attention.png --json
    ctxwarden diag lengths LOG --png ...   and   ctxwarden diag slo-risk LOG --ttft 2s

Each command's output goes to benchmarks/results/diagnostics_demo.md (a transcript, with the
machine and load noted) and the PNGs to docs/img/. Run: `nice -n 10 .venv/bin/python
benchmarks/diagnostics_demo.py` (about 3-6 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from replay_trace import free_port, start_server  # noqa: E402

CORPUS = Path("/work/shared/corpora/austen/prideprejudice.txt")
if not CORPUS.exists():
    CORPUS = ROOT.parent / "shared" / "corpora" / "austen" / "prideprejudice.txt"
MODEL = "SmolLM2-135M-Instruct"
ATTENTION_PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.")


def passages(text: str, num: int, seed: int = 0) -> list[str]:
    """`num` passages of 150-2,400 characters from the book; every third shares the previous one's
    opening, so its prefix comes from the prefix cache."""
    import random

    rng = random.Random(seed)
    body = text[text.index("Chapter 1"):]
    out = []
    for i in range(num):
        if i % 3 == 2:
            out.append(out[-1][:len(out[-1]) * 3 // 4] + " " + body[rng.randrange(len(body) - 400):][:300])
            continue
        start, length = rng.randrange(len(body) - 3000), int(150 * (16 ** rng.random()))
        out.append(body[start:start + length])
    return out


def one_request(url: str, index: int, passage: str) -> dict:
    """One chat request with its own x-request-id; returns its id and usage."""
    import httpx

    body = {"model": MODEL, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Summarise in one sentence:\n\n" + passage}]}
    trace = f"00-{index + 1:032x}-{index + 1:016x}-01"  # a W3C traceparent: the trace id shows up everywhere
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": f"demo-{index}",
                                                                       "traceparent": trace}, timeout=600)
    r.raise_for_status()
    return {"request_id": f"demo-{index}", "usage": r.json()["usage"]}


def run_cli(args: list[str]) -> str:
    """A `ctxwarden` command's stdout and stderr (a wide terminal, no colour); --json output
    trimmed to each list's first items (floats rounded)."""
    env = {**os.environ, "COLUMNS": "112", "NO_COLOR": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-m", "ctxwarden", *args], capture_output=True, text=True, env=env,
                          timeout=900)
    if "--json" in args and done.returncode == 0:
        return json.dumps(trim(json.loads(done.stdout)))
    return (done.stdout + done.stderr).rstrip()


def trim(value, num_items: int = 3):
    """JSON made short for a page: lists cut to `num_items` (then "..."), floats to 4 digits."""
    if isinstance(value, dict):
        return {k: trim(v, num_items) for k, v in value.items()}
    if isinstance(value, list):
        head = [trim(v, num_items) for v in value[:num_items]]
        return head + ["..."] if len(value) > num_items else head
    return float(f"{value:.4g}") if isinstance(value, float) else value


def machine_note() -> str:
    """CPU model, CPU count and the load average now."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"


def commands(url: str, log: Path, img: Path) -> list[tuple[str, list[str]]]:
    """The commands the docs show, in order (title, argv after `ctxwarden`)."""
    return [
        ("diag mem snapshot --url", ["diag", "mem", "snapshot", "--url", url]),
        ("doctor --url", ["doctor", "--url", url]),
        ("diag timeline --url --png", ["diag", "timeline", "--url", url, "--png", str(img / "diag-timeline.png")]),
        ("diag lengths (the server's request log)", ["diag", "lengths", str(log), "--png",
                                                     str(img / "diag-lengths-server.png")]),
        ("diag slo-risk --ttft 2s (the server's request log)", ["diag", "slo-risk", str(log), "--ttft", "2s",
                                                                "--png", str(img / "diag-slo-risk-server.png")]),
        ("diag attention PROMPT --png", ["diag", "attention", ATTENTION_PROMPT, "--png",
                                         str(img / "diag-attention.png")]),
        ("diag attention PROMPT --json", ["diag", "attention", ATTENTION_PROMPT, "--json"]),
    ]


def serve_traffic(progress, url: str, prompts: list[str], concurrency: int) -> list[dict]:
    """Send every prompt, `concurrency` at a time, advancing a progress bar."""
    task = progress.add_task("requests", total=len(prompts))
    out = []
    with ThreadPoolExecutor(concurrency) as pool:
        for result in pool.map(lambda ip: one_request(url, *ip), enumerate(prompts)):
            out.append(result)
            progress.advance(task)
    return out


def live_attention(url: str, request_id: str) -> str:
    """GET /debug/attention/{request_id}, trimmed (`trim`)."""
    import httpx

    record = httpx.get(f"{url}/debug/attention/{request_id}", timeout=30).json()
    return json.dumps(trim(record))


def slope_metrics(url: str, num_completed: int, timeout_s: float = 30.0) -> str:
    """The slow-leak slope's lines of /metrics, once its fit covers every request served."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                 if line.startswith("ctxwarden_process_rss_slope")]
        done = [line for line in lines if line.startswith("ctxwarden_process_rss_slope_completed_requests ")]
        if (done and float(done[0].split()[-1]) >= num_completed) or time.monotonic() > deadline:
            return "\n".join(lines)
        time.sleep(1.0)


def main() -> int:
    """Serve, send traffic, run the commands, write the transcript."""
    from rich.progress import Progress

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=36)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kv-memory", default="512MiB")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "diagnostics_demo.md"))
    p.add_argument("--img", default=str(ROOT / "docs" / "img"))
    args = p.parse_args()
    work, img = Path(tempfile.mkdtemp(prefix="diag-demo-")), Path(args.img)
    img.mkdir(parents=True, exist_ok=True)
    log, port = work / "requests.jsonl", free_port()
    url = f"http://127.0.0.1:{port}"
    prompts = passages(CORPUS.read_text(encoding="utf-8"), args.requests)
    sections = [f"# diagnostics demo on {MODEL}\n\nmachine at start: {machine_note()}\n"]
    t0 = time.time()
    with Progress() as progress:
        step = progress.add_task("diagnostics demo", total=3 + len(commands(url, log, img)))
        server = start_server(None, port, args.kv_memory, ("--request-log", str(log), "--crash-dir",
                                                          str(work / "crash"), "--attention-sample-rate", "1",
                                                          "--leak-warmup-requests", "0"))
        progress.advance(step)
        try:
            served = serve_traffic(progress, url, prompts, args.concurrency)
            progress.advance(step)
            sections.append(f"## {len(served)} requests served\n\n" + ", ".join(
                f"{s['request_id']}: {s['usage']['prompt_tokens']} prompt tokens" for s in served[:6]) + ", ...")
            sections.append("## GET /debug/attention/demo-2\n\n```json\n" + live_attention(url, "demo-2") + "\n```")
            sections.append("## /metrics: the slow-leak slope\n\n```\n" + slope_metrics(url, len(served)) + "\n```")
            progress.advance(step)
            for title, argv in commands(url, log, img):
                sections.append(f"## ctxwarden {title}\n\n```\n{run_cli(argv)}\n```")
                progress.advance(step)
        finally:
            server.terminate()
            server.wait(timeout=60)
    sections.append(f"machine at the end: {machine_note()}; wall {time.time() - t0:.0f} s")
    Path(args.out).write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    print(f"transcript written to {args.out}; PNGs in {img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
