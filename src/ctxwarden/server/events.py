"""The event ring: a bounded, thread-safe record of what happened to requests (no torch).

    kinds: arrival (the server got it)   admit (the engine queued it)   refuse (turned away)
           schedule (its first chunk ran) preempt (pushed out: swap | recompute)
           swap (swapped back in)        error (a failed step, or the engine died)
           abort (client gone, shutdown) finish (stop or length)

Each event: wall time, kind, request id (the client's x-request-id), tenant, trace id (W3C
traceparent), model and a small detail dict; never prompt text. `record` appends one tuple
to a `collections.deque(maxlen=N)` (append is atomic under the GIL, so the asyncio thread
and the engine threads record without a lock); the oldest events fall off the far end.
`benchmarks/event_ring.py` measures the cost per record.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

EVENT_KINDS = ("arrival", "admit", "refuse", "schedule", "preempt", "swap", "error", "abort", "finish")
DEFAULT_CAPACITY = 20_000
_FIELDS = ("seq", "time", "kind", "request_id", "tenant", "trace_id", "model", "detail")


class EventRing:
    """The last `capacity` events, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock=time.time):
        if capacity < 1:
            raise ValueError(f"the event ring needs capacity >= 1, got {capacity}")
        self.capacity, self._clock = capacity, clock
        self._ring: deque = deque(maxlen=capacity)
        self._seq = itertools.count()  # next() is atomic under the GIL too

    def record(self, kind: str, request_id: str | None = None, tenant: str | None = None,
               trace_id: str | None = None, model: str | None = None, detail: dict | None = None) -> None:
        """Append one event (kinds: EVENT_KINDS; not checked here: this is the hot path)."""
        self._ring.append((next(self._seq), self._clock(), kind, request_id, tenant, trace_id, model, detail))

    def record_tags(self, kind: str, tags, model: str | None = None, detail: dict | None = None) -> None:
        """Append one event for a request's RequestTags (server.owners)."""
        if tags is None:
            self.record(kind, model=model, detail=detail)
        else:
            self.record(kind, tags.request_id, tags.tenant, tags.trace_id, model, detail)

    def __len__(self) -> int:
        return len(self._ring)

    def events(self, since: float | None = None, request_id: str | None = None) -> list[dict]:
        """Events as dicts, oldest first; only those at or after `since` (unix s) and of
        `request_id` when given."""
        rows = list(self._ring)  # a copy: appends continue meanwhile
        out = []
        for row in rows:
            if (since is not None and row[1] < since) or (request_id is not None and row[3] != request_id):
                continue
            out.append(dict(zip(_FIELDS, row)))
        return out
