"""Fetch or recompute: a cost model over measured rates (no torch).

    recompute_s(tokens)     = tokens / prefill tokens per second
    fetch_s(tier, blocks)   = round trips x latency + bytes x seconds per byte
                              (seconds per byte covers the transfer *and* the checksums,
                               since it is measured over whole fetches, verify included)

The prefill rate is calibrated at start-up (the engine times one real prefill) and then
follows real prefill steps; each tier's latency follows its lookups, as moving averages.
A tier's seconds per byte believes bad news at once (a fetch slower than the estimate sets
it) and good news gradually (faster fetches pull it down by a moving average): one slow
fetch is enough to stop fetching from a slowed link. A tier that is being skipped is not
measured any more, so once its last fetch is `reprobe_s` old one request fetches anyway (a
probe): the fetch's own deadline bounds what a probe of a still-slow link costs.
A fetch gets a deadline at the break-even point: past it (or projected past it, see
KVTiers.fetch) recompute would have won, so the rest is abandoned and recomputed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

# Priors until a tier is measured: (latency s, bytes per s incl. checksums).
_PRIORS = {"ram": (2e-5, 3e9), "disk": (2e-4, 8e8), "redis": (5e-4, 5e8)}
_ALPHA = 0.3  # weight of a new observation


@dataclass(frozen=True)
class Decision:
    """The cost model's answer for one run of blocks in one tier."""

    tier: str
    action: str  # "fetch" | "skipped"
    fetch_s: float
    recompute_s: float
    is_probe: bool = False  # fetched although estimated slower: the estimate is stale

    @property
    def is_fetch(self) -> bool:
        return self.action == "fetch"


class CostModel:
    """Measured prefill rate and per-tier fetch costs; decides fetch or recompute."""

    def __init__(self, prefill_tokens_per_s: float = 2000.0, reprobe_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if prefill_tokens_per_s <= 0 or reprobe_s < 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0 and reprobe_s >= 0, got "
                             f"{prefill_tokens_per_s}, {reprobe_s}")
        self.prefill_tokens_per_s, self.reprobe_s, self._clock = prefill_tokens_per_s, reprobe_s, clock
        self._latency_s = {t: p[0] for t, p in _PRIORS.items()}
        self._s_per_byte = {t: 1.0 / p[1] for t, p in _PRIORS.items()}
        self._measured_at: dict[str, float] = {}  # the last fetch of each tier
        self._lock = threading.Lock()

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` at the measured rate."""
        return num_tokens / self.prefill_tokens_per_s

    def fetch_s(self, tier: str, num_bytes: int, num_round_trips: int = 1) -> float:
        """Seconds to fetch and verify `num_bytes` from `tier`."""
        return num_round_trips * self._latency_s[tier] + num_bytes * self._s_per_byte[tier]

    def decide(self, tier: str, num_tokens: int, num_bytes: int, num_round_trips: int) -> Decision:
        """Fetch when it beats recomputing the same tokens, else skip the tier (but probe a
        tier whose estimate is older than `reprobe_s`)."""
        fetch, recompute = self.fetch_s(tier, num_bytes, num_round_trips), self.recompute_s(num_tokens)
        if fetch < recompute:
            return Decision(tier, "fetch", fetch, recompute)
        measured_at = self._measured_at.get(tier)
        if measured_at is not None and self._clock() - measured_at > self.reprobe_s:
            return Decision(tier, "fetch", fetch, recompute, is_probe=True)
        return Decision(tier, "skipped", fetch, recompute)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill of `num_tokens` took `seconds` (calibration or a real step)."""
        if num_tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_tokens_per_s += _ALPHA * (num_tokens / seconds - self.prefill_tokens_per_s)

    def calibrate_prefill(self, num_tokens: int, seconds: float) -> None:
        """Set the prefill rate from a start-up measurement (replaces the prior)."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = num_tokens / seconds

    def observe_latency(self, tier: str, seconds: float) -> None:
        """One round trip to `tier` (a lookup) took `seconds`."""
        with self._lock:
            self._latency_s[tier] += _ALPHA * (seconds - self._latency_s[tier])

    def observe_fetch(self, tier: str, num_bytes: int, seconds: float, num_round_trips: int) -> None:
        """A fetch of `num_bytes` (verify included) took `seconds`."""
        if num_bytes <= 0:
            return
        with self._lock:
            per_byte = max(0.0, seconds - num_round_trips * self._latency_s[tier]) / num_bytes
            old = self._s_per_byte[tier]
            self._s_per_byte[tier] = per_byte if per_byte > old else old + _ALPHA * (per_byte - old)
            self._measured_at[tier] = self._clock()

    def bytes_per_s(self, tier: str) -> float:
        """The tier's measured fetch bandwidth (verify included)."""
        return 1.0 / self._s_per_byte[tier] if self._s_per_byte[tier] > 0 else float("inf")

    def latency_s(self, tier: str) -> float:
        """The tier's measured round-trip latency."""
        return self._latency_s[tier]
