"""What one event costs: `EventRing.record` against a bare deque append, side by side.

A request records about four events (arrival, admit, schedule, finish); preemptions and
swaps add one each. This times N records into a full ring (the steady state: every append
drops the oldest), repeated, and the same N appends of a tuple to a bare bounded deque (the
floor), plus one `events()` read of the whole ring (what /debug/events pays).

Run: .venv/bin/python benchmarks/event_ring.py [--records 200000] [--repeats 7]
Writes benchmarks/results/event_ring.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import deque
from pathlib import Path

from ctxwarden.server.events import DEFAULT_CAPACITY, EventRing
from ctxwarden.server.owners import RequestTags

ROOT = Path(__file__).resolve().parents[1]


def time_ring(n: int) -> float:
    ring = EventRing()
    tags = RequestTags("3f2a9c1d7e6b4a58b0c9d8e7f6a5b4c3", "alpha", "4bf92f3577b34da6a3ce929d0e0e4736")
    detail = {"engine_request_id": "cmpl-0", "prompt_tokens": 1000}
    for _ in range(DEFAULT_CAPACITY):  # fill it: the steady state drops the oldest
        ring.record_tags("admit", tags, "m", detail)
    start = time.perf_counter_ns()
    for _ in range(n):
        ring.record_tags("admit", tags, "m", detail)
    return (time.perf_counter_ns() - start) / n


def time_deque(n: int) -> float:
    d: deque = deque(maxlen=DEFAULT_CAPACITY)
    row = (0, 0.0, "admit", "id", "alpha", "trace", "m", None)
    for _ in range(DEFAULT_CAPACITY):
        d.append(row)
    start = time.perf_counter_ns()
    for _ in range(n):
        d.append(row)
    return (time.perf_counter_ns() - start) / n


def time_read() -> float:
    ring = EventRing()
    for i in range(DEFAULT_CAPACITY):
        ring.record("admit", f"r{i}", "alpha")
    start = time.perf_counter()
    ring.events()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    ring = [time_ring(args.records) for _ in range(args.repeats)]
    floor = [time_deque(args.records) for _ in range(args.repeats)]
    reads = [time_read() for _ in range(args.repeats)]
    out = {"records_per_repeat": args.records, "repeats": args.repeats, "capacity": DEFAULT_CAPACITY,
           "record_ns": {"median": statistics.median(ring), "min": min(ring), "max": max(ring)},
           "bare_deque_append_ns": {"median": statistics.median(floor), "min": min(floor), "max": max(floor)},
           "ratio_to_bare_append": statistics.median(ring) / statistics.median(floor),
           "read_full_ring_ms": {"median": statistics.median(reads) * 1e3, "min": min(reads) * 1e3,
                                 "max": max(reads) * 1e3},
           "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "load_average": os.getloadavg()}}
    path = ROOT / "benchmarks" / "results" / "event_ring.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
