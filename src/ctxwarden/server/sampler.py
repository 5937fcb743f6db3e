"""Memory samples at 1 Hz for the incident timeline (a daemon thread; no torch).

Each sample: wall time; this process's RssAnon, RssFile, VmSwap and their leak basis
(RssAnon + VmSwap, one read of /proc/self/status); the memory cgroup's usage and its OOM-kill
count (None without a memory cgroup); and per engine, read from what its thread last
published (never waiting on a step): KV blocks in use / cached / total, requests running and
waiting (the queue depth); and the requests completed so far. Kept in a ring of `capacity`
samples (an hour at 1 Hz).

Every SLOPE_REFIT_SAMPLES samples (when requests completed meanwhile) the same thread refits
the slow-leak slope (diagnostics.leaks.per_request_slope: Theil-Sen of RssAnon + VmSwap
against completed requests, over the ring, after `warmup_requests`); /metrics exports the
last fit and never computes one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ctxwarden.diagnostics.cgroup import lookup_cgroup
from ctxwarden.diagnostics.leaks import RequestSlope, per_request_slope
from ctxwarden.diagnostics.process_memory import read_proc_status

log = logging.getLogger("ctxwarden.server")
SAMPLE_INTERVAL_S = 1.0
DEFAULT_CAPACITY = 3600
SLOPE_REFIT_SAMPLES = 10  # the slope is refitted every 10 samples (10 s at 1 Hz)
DEFAULT_WARMUP_REQUESTS = 100  # caches that fill per new prompt length grow memory at first


def take_sample(engines, cgroup_root: str) -> dict:
    """One sample (module doc) as a JSON-ready dict."""
    status = read_proc_status()
    cg = lookup_cgroup("self", cgroup_root).memory
    return {"time": time.time(), "rss_anon_bytes": status["rss_anon_bytes"], "rss_file_bytes": status["rss_file_bytes"],
            "swap_bytes": status["swap_bytes"], "leak_basis_bytes": status["rss_anon_bytes"] + status["swap_bytes"],
            "cgroup_current_bytes": cg.memory_current_bytes if cg else None,
            "oom_kill": cg.events.get("oom_kill") if cg else None,
            "engines": {e.name: _engine_sample(e) for e in engines}}


def _engine_sample(engine) -> dict:
    s = engine.stats
    return {"kv_blocks_in_use": s.kv.num_blocks_in_use, "kv_blocks_cached": s.kv.num_blocks_cached,
            "kv_blocks_total": s.kv.num_blocks_total, "running": s.num_running,
            "waiting": s.num_waiting + s.num_swapped}


class MemorySampler:
    """Samples every `interval_s` on its own thread until `stop()`; `samples()` reads them."""

    def __init__(self, engines_of, cgroup_root: str, interval_s: float = SAMPLE_INTERVAL_S,
                 capacity: int = DEFAULT_CAPACITY, completed_of=None,
                 warmup_requests: int = DEFAULT_WARMUP_REQUESTS):
        if interval_s <= 0:
            raise ValueError(f"the memory sample interval must be > 0 s, got {interval_s}")
        if warmup_requests < 0:
            raise ValueError(f"the slope's warm-up must be >= 0 requests, got {warmup_requests}")
        self.engines_of, self.cgroup_root, self.interval_s = engines_of, cgroup_root, interval_s
        self.completed_of, self.warmup_requests = completed_of, warmup_requests
        self.slope: RequestSlope | None = None  # the last fit (None until enough samples)
        self._fitted_at_completed: int | None = None
        self._ring: deque = deque(maxlen=capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        """Start sampling on the daemon thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop sampling (the samples stay readable)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample_now(self) -> dict:
        """Take one sample now (also recorded)."""
        sample = take_sample(self.engines_of(), self.cgroup_root)
        sample["completed_requests"] = self.completed_of() if self.completed_of is not None else None
        self._ring.append(sample)
        return sample

    def refit_slope(self) -> RequestSlope | None:
        """Refit the slow-leak slope over the ring now (also kept in `slope`)."""
        samples = list(self._ring)
        self.slope = per_request_slope(samples, self.warmup_requests)
        self._fitted_at_completed = samples[-1]["completed_requests"] if samples else None
        return self.slope

    def latest(self) -> dict | None:
        """The newest sample, None before the first."""
        try:
            return self._ring[-1]
        except IndexError:
            return None

    def samples(self, since: float | None = None) -> list[dict]:
        """Samples at or after `since` (unix s), oldest first."""
        return [s for s in list(self._ring) if since is None or s["time"] >= since]

    def _run(self) -> None:
        next_at, num_samples = time.monotonic(), 0
        while not self._stop.is_set():
            try:
                sample = self.sample_now()
                num_samples += 1
                if num_samples % SLOPE_REFIT_SAMPLES == 0 and sample["completed_requests"] != self._fitted_at_completed:
                    self.refit_slope()
            except Exception:  # noqa: BLE001 - a failed read must not end the sampling
                log.exception("memory sample failed")
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))
