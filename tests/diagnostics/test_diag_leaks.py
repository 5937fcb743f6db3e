"""Slow-leak detector: a real planted leak is measured, a clean process is cleared, TTFT drift
is separated from prompt-length drift, and malloc_trim really returns retained pages."""

import subprocess
import sys

import numpy as np
import pytest

from ctxwarden.diagnostics.leaks import (LeakSample, assess_leak, huber_regression, robust_slope,
                                         ttft_drift)
from ctxwarden.diagnostics.process_memory import read_leak_basis_bytes

KiB, MiB = 2**10, 2**20


def serve_requests(child, num_requests, leak_bytes):
    """Drive the child like a server: each request churns 1 MiB and keeps `leak_bytes`."""
    samples = []
    for i in range(1, num_requests + 1):
        child.send(f"churn {MiB}")
        if leak_bytes:
            child.send(f"keep {leak_bytes}")
        samples.append(LeakSample(i, read_leak_basis_bytes(child.pid)))
    return samples


def test_planted_256_kib_per_request_leak_is_measured(child):
    report = assess_leak(serve_requests(child, 300, 256 * KiB))
    assert report.rss.slope == pytest.approx(256 * KiB, rel=0.2)
    assert report.rss.r_squared > 0.9
    assert report.rss.slope_low > 0
    assert report.verdict == "leak", report.reason


def test_a_clean_process_has_a_slope_interval_containing_zero(child):
    report = assess_leak(serve_requests(child, 300, 0))
    assert report.rss.contains_zero, report.rss
    assert report.verdict == "no leak", report.reason


def test_theil_sen_shrugs_off_spikes_that_move_least_squares():
    rng = np.random.default_rng(0)
    x = np.arange(1, 401)
    y = 500e6 + 4096.0 * x + rng.normal(0, 20_000, x.size)
    y[rng.choice(x.size, 30, replace=False)] += 80e6  # GC / arena spikes
    fit = robust_slope(x, y)
    ols = np.polyfit(x, y, 1)[0]
    assert fit.slope == pytest.approx(4096, rel=0.05)
    assert abs(ols - 4096) > abs(fit.slope - 4096)
    assert fit.slope_low < 4096 < fit.slope_high


def test_a_step_is_inconclusive_not_a_leak():
    x = np.arange(1, 301)
    y = np.where(x < 150, 400e6, 464e6) + np.random.default_rng(1).normal(0, 4e6, x.size)
    report = assess_leak([LeakSample(int(a), int(b)) for a, b in zip(x, y)])
    assert report.rss.slope_low > 0 and report.rss.r_squared < 0.9
    assert report.verdict in ("inconclusive", "leak")
    flat = assess_leak([LeakSample(int(a), int(b)) for a, b in zip(x, y)], warmup_requests=150)
    assert flat.verdict == "no leak"  # after the step, nothing grows


def test_growth_that_trim_removes_is_allocator_retention():
    samples = [LeakSample(i, 300 * MiB + i * 64 * KiB, trimmed_leak_basis_bytes=250 * MiB + (i % 3) * 4096)
               for i in range(1, 201)]
    report = assess_leak(samples)
    assert report.verdict == "allocator retention", report.reason
    assert report.trimmed.contains_zero


def test_ttft_drift_is_adjusted_for_prompt_length():
    rng = np.random.default_rng(2)
    n = 400
    completed = np.arange(1, n + 1)
    prompt = rng.integers(100, 800, n) + completed * 4  # the mix drifts longer over time
    base = 0.02 + 3e-4 * prompt + 1e-7 * prompt**2
    noisy = lambda t: t * rng.lognormal(0, 0.05, n)
    clean = ttft_drift(completed, prompt, noisy(base))
    assert clean.contains_zero, clean
    naive = robust_slope(completed, noisy(base))
    assert naive.slope_low > 0  # without the adjustment the longer prompts look like drift
    drifting = ttft_drift(completed, prompt, noisy(base + 5e-4 * completed))  # 0.5 s per 1,000
    assert drifting.seconds_per_1000_requests == pytest.approx(0.5, rel=0.15)
    assert drifting.low > 0


def test_huber_regression_ignores_outliers():
    rng = np.random.default_rng(3)
    X = np.stack([np.ones(300), rng.uniform(0, 1, 300)], axis=1)
    y = X @ np.array([1.0, 2.0]) + rng.normal(0, 0.01, 300)
    y[:15] += 50.0
    assert huber_regression(X, y) == pytest.approx([1.0, 2.0], abs=0.05)


def test_bad_series_are_refused():
    with pytest.raises(ValueError, match="at least 10 paired samples"):
        robust_slope([1, 2], [3, 4])
    with pytest.raises(ValueError, match="the same x"):
        robust_slope([5] * 20, list(range(20)))


def test_trim_probe_returns_freed_heap_pages():
    # In a fresh interpreter: 64 MiB in 2 KiB malloc'ed pieces, all freed but the last (which
    # pins the heap top, so glibc cannot shrink it by itself); malloc_trim(0) must return it.
    code = (
        "from ctxwarden.diagnostics.leaks import trim_probe\n"
        "from ctxwarden.diagnostics.process_memory import read_leak_basis_bytes as basis\n"
        "start = basis()\n"
        "pieces = [bytearray(b'x') * 2048 for _ in range(32768)]\n"
        "del pieces[:-1]\n"
        "held = basis() - start\n"
        "r = trim_probe()\n"
        "print(held, r.released_bytes, r.is_available)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    held, released, available = out.stdout.split()
    assert available == "True"
    assert int(held) > 48 * MiB  # retained after free: what looks like a leak
    assert int(released) > 40 * MiB


def test_cli_leak_judges_a_samples_file(tmp_path, cli):
    import json

    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"completed_requests": i, "leak_basis_bytes": 10 * MiB + i * 8 * KiB})
                            + "\n" for i in range(1, 101)))
    rc, out, _ = cli("diag", "leak", path, "--json")
    got = json.loads(out)
    assert rc == 0
    assert got["verdict"] == "leak" and got["rss"]["slope"] == pytest.approx(8 * KiB)
    assert got["trimmed"] is None and got["ttft"] is None
    path.write_text('{"requests": 3}\n')
    rc, _, err = cli("diag", "leak", path)
    assert rc == 2 and "not leak samples" in err


def test_cli_leak_samples_a_live_engine(tmp_path, tiny_model_dir, cli):
    import json

    samples = tmp_path / "live.jsonl"
    png = tmp_path / "leak.png"
    rc, out, _ = cli("diag", "leak", "--model", tiny_model_dir, "--requests", "20", "--prompt-tokens", "16",
                     "--max-tokens", "2", "--trim-probe", "--samples-out", samples, "--png", png, "--json")
    got = json.loads(out)
    assert rc == 0
    assert got["verdict"] in ("leak", "no leak", "inconclusive", "allocator retention")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["completed_requests"] for r in rows] == list(range(1, 21))
    assert all(8 <= r["prompt_tokens"] <= 16 and r["ttft_s"] > 0 for r in rows)
    assert all(r["trimmed_leak_basis_bytes"] <= r["leak_basis_bytes"] + MiB for r in rows)
    assert got["ttft"]["num_samples"] == 20
    assert png.read_bytes()[:4] == b"\x89PNG"
