"""`ctxwarden serve` as a process: SIGTERM drains running requests and refuses new ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 60.0


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during startup"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def test_sigterm_drains_then_exits_zero(long_window_dir, free_port, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "ctxwarden", "serve", "--model", str(long_window_dir),
                             "--port", str(port), "--kv-memory", "16MiB", "--drain-timeout", "60"],
                            stdout=subprocess.DEVNULL, stderr=log_path.open("w"), env=env)
    try:
        _wait_ready(url, proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as running:
            lines = running.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            rest = list(lines)  # the running request is drained, not cut
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(rest)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    logs = log_path.read_text()
    assert "draining 1 request(s)" in logs
