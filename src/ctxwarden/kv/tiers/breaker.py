"""A circuit breaker: after a few failures in a row a tier is skipped at once (no torch).

    closed     calls go through; `failure_threshold` failures in a row -> open
    open       calls are refused without touching the tier; after `cooldown_s`, or when
               the health probe succeeds -> half-open (probe success closes it directly)
    half_open  one trial call goes through: success -> closed, failure -> open again

A refused call costs nothing, so a dead or hung tier slows at most `failure_threshold`
calls (each bounded by its timeout) before every request simply recomputes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's encoding


class CircuitBreaker:
    """Counts consecutive failures of one tier and decides whether to call it."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        if failure_threshold < 1 or cooldown_s < 0:
            raise ValueError(f"failure_threshold must be >= 1 and cooldown_s >= 0, got "
                             f"{failure_threshold}, {cooldown_s}")
        self.failure_threshold, self.cooldown_s, self._clock = failure_threshold, cooldown_s, clock
        self._lock = threading.Lock()
        self._state, self._failures, self._opened_at = CLOSED, 0, 0.0
        self._trial_out = False
        self.num_opens = 0

    @property
    def state(self) -> str:
        """closed, half_open or open (open turns half_open once the cooldown has passed)."""
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state, self._trial_out = HALF_OPEN, False
            return self._state

    def allow(self) -> bool:
        """Whether to call the tier now (half-open lets one trial call through at a time)."""
        state = self.state
        with self._lock:
            if state == CLOSED:
                return True
            if state == HALF_OPEN and not self._trial_out:
                self._trial_out = True
                return True
            return False

    def record_success(self) -> None:
        """A call (or the health probe) worked: close."""
        with self._lock:
            self._state, self._failures, self._trial_out = CLOSED, 0, False

    def record_failure(self) -> None:
        """A call failed or timed out: open after `failure_threshold` in a row."""
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN or self._failures >= self.failure_threshold:
                if self._state != OPEN:
                    self.num_opens += 1
                self._state, self._opened_at, self._trial_out = OPEN, self._clock(), False
