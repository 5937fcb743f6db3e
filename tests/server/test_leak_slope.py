"""The slow-leak slope on /metrics of a live server: a planted per-request leak and clean traffic.

The leak is planted in the server's own process: an HTTP middleware (a test hook around the
real app) keeps 256 KiB of written bytes for every completion request it passes. The
server's memory samples (every 0.05 s here instead of 1 s) pair RssAnon + VmSwap with the
completed requests; the sampler refits Theil-Sen every 10 samples and /metrics exports it.
"""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import ServerThread

from ctxwarden.diagnostics.doctor import server_findings
from ctxwarden.diagnostics.leaks import malloc_trim
from ctxwarden.server.app import ServerConfig, create_app

LEAK_BYTES = 256 * 1024
NUM_WARMUP = 20  # the server's own warm-up (ServerConfig.leak_warmup_requests)
NUM_REQUESTS = 280  # after the warm-up: 300 in all, as in the issue
# Within 20% (the issue's bound for the offline detector): the planted bytes plus page
# rounding and the allocator's own bookkeeping, against the noise of the test client's
# threads, which share the process (measured: 258,809-271,122 B/request, R^2 >= 0.992, 8 runs).
LEAK_TOLERANCE = 0.20
# Clean traffic: 0.7-11.0 KiB per request measured (8 runs, R^2 <= 0.45), not attributed (an
# event ring of 10 instead of 20,000 reads the same); 32 KiB is 12% of the planted leak.
# Doctor calls a server's slope a leak only from 16 KiB/request with R^2 >= 0.5.
CLEAN_BOUND_BYTES = 32 * 1024
SLOPE = "ctxwarden_process_rss_slope_bytes_per_request"


def _app(tiny_dir, kept: list | None):
    config = ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", memory_sample_interval_s=0.05,
                                leak_warmup_requests=NUM_WARMUP)

    def make():
        app = create_app(config)
        if kept is not None:
            @app.middleware("http")
            async def leak(request, call_next):  # the planted leak: 256 KiB kept per completion
                response = await call_next(request)
                if request.url.path.startswith("/v1/"):
                    kept.append(bytearray(b"\x01") * LEAK_BYTES)
                return response
        return app
    return make


def _traffic(server: ServerThread, num: int) -> None:
    model = server.app.state.server.engines[0].name
    body = {"model": model, "prompt": "the same short prompt for every request", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: client.post(server.url + "/v1/completions", json=body).status_code,
                              range(num)))
    assert codes == [200] * num


def _fitted(server: ServerThread, num_completed: int, timeout_s: float = 20.0) -> dict:
    """Poll /metrics until the slope's fit covers `num_completed` requests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metric("ctxwarden_process_rss_slope_completed_requests") >= num_completed:
            return {b: server.metric(SLOPE, bound=b) for b in ("estimate", "low", "high")} | {
                "r2": server.metric("ctxwarden_process_rss_slope_r_squared")}
        time.sleep(0.1)
    raise AssertionError(f"the slope never covered {num_completed} completed requests")


@pytest.mark.parametrize("planted", [True, False], ids=["leak-256KiB", "clean"])
def test_the_leak_slope_gauge_reads_a_planted_leak_and_zero_on_clean_traffic(tiny_dir, planted):
    kept = [] if planted else None
    # earlier tests' garbage (engines of hundreds of MiB in reference cycles) must not be
    # collected in the middle of this one: that drop would be read as a negative slope
    gc.collect()
    malloc_trim()
    server = ServerThread(_app(tiny_dir, kept)).start()
    try:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert f"# TYPE {SLOPE} gauge" in text and f"{SLOPE}{{" not in text  # no fit before any request
        _traffic(server, NUM_WARMUP + NUM_REQUESTS)
        got = _fitted(server, NUM_WARMUP + NUM_REQUESTS)
        snap = httpx.get(server.url + "/debug/memory", timeout=30).json()
    finally:
        server.stop()
    if planted:
        assert len(kept) == NUM_WARMUP + NUM_REQUESTS
        assert abs(got["estimate"] - LEAK_BYTES) <= LEAK_TOLERANCE * LEAK_BYTES, got
        assert got["low"] > 0 and got["r2"] > 0.9, got
    else:
        assert got["low"] <= 0 <= got["high"] or abs(got["estimate"]) < CLEAN_BOUND_BYTES, got
    assert got["low"] <= got["estimate"] <= got["high"]
    # the same fit in /debug/memory, and doctor --url's finding from it
    assert snap["leak_slope"]["first_completed"] >= NUM_WARMUP and snap["leak_slope"]["unit"] == "bytes per request"
    finding = [f for f in server_findings(snap) if f.what.startswith("server memory per completed request")]
    assert len(finding) == 1
    assert (finding[0].what.endswith(": leak") and finding[0].severity == "high") if planted \
        else not finding[0].what.endswith(": leak")
