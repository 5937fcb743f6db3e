"""Per-tier counters, kept by the tier client and returned as frozen TierStats (no torch)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass

FETCH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DECISIONS = ("fetch", "recompute", "skipped")


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers. Hits and misses count blocks; decisions count requests.

    Decisions: `fetch` (the cost model chose to fetch), `skipped` (the tier held blocks
    but recompute was cheaper, or the prefix was too short to look), `recompute` (a fetch
    fell short: a deadline, a failure or a bad value; the rest was recomputed).
    """

    tier: str
    breaker_state: str
    is_degraded: bool  # writes suspended after an error (a full disk), reads still served
    num_breaker_opens: int
    num_lookups: int
    num_hit_blocks: int
    num_miss_blocks: int
    bytes_in: int  # stored into the tier
    bytes_out: int  # fetched (and verified) from it
    fetch_bucket_counts: tuple[int, ...]  # cumulative is computed by the renderer
    fetch_seconds_sum: float
    num_fetches: int
    verify_seconds_sum: float  # of the fetch time: headers, checksums, commit records
    integrity_failures: tuple[tuple[str, int], ...]
    decisions: tuple[tuple[str, int], ...]
    num_stores: int
    num_dropped_stores: int
    num_store_errors: int
    used_bytes: int
    capacity_bytes: int | None
    num_values: int

    def integrity(self, reason: str) -> int:
        """Integrity failures of one reason."""
        return dict(self.integrity_failures).get(reason, 0)

    def decision(self, action: str) -> int:
        """Requests that got one decision."""
        return dict(self.decisions).get(action, 0)


class TierCounters:
    """The mutable counters behind TierStats (the writer thread and the engine both count)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.integrity: Counter = Counter()
        self.decisions: Counter = Counter()
        self.fetch_buckets = [0] * (len(FETCH_BUCKETS_S) + 1)
        self.fetch_seconds_sum = 0.0

    def add(self, **amounts: float) -> None:
        """Add to named counters (num_lookups=1, bytes_out=4096, ...)."""
        with self.lock:
            self.counts.update(amounts)

    def observe_fetch(self, seconds: float) -> None:
        """One fetch's wall time, into the latency histogram."""
        with self.lock:
            self.fetch_buckets[bisect.bisect_left(FETCH_BUCKETS_S, seconds)] += 1
            self.fetch_seconds_sum += seconds
            self.counts["num_fetches"] += 1

    def count_integrity(self, reason: str) -> None:
        """A value failed verification for `reason`."""
        with self.lock:
            self.integrity[reason] += 1

    def count_decision(self, action: str) -> None:
        """One request's decision for this tier."""
        with self.lock:
            self.decisions[action] += 1
