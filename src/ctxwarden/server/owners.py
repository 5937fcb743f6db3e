"""KV owners: which request (id, tenant, trace) holds which KV blocks, since when, at what risk.

    engine thread:  admit(choice)  -> remember the choice's tags and arrival
                    finish(choice) -> its finish time, its latency into the p99 window
                    owners(holders) after each step (with the stats snapshot): one record
                    per holding sequence, blocks nobody holds as one CRITICAL record;
                    tags of finished choices that hold nothing are dropped (bounded)

Risk (diagnostics.snapshot.owner_risk): a live owner is OK; a finished owner still holding
blocks is HIGH once more than 2x the p99 request latency has passed since it finished (the
p99 of the last LATENCY_WINDOW requests, at least MIN_P99_S so one step's lag is no alarm);
blocks whose request nobody knows are CRITICAL. No torch: the engine hands over KVHolders.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ctxwarden.diagnostics.snapshot import (FINISHED_STATE, LIVE_STATES, NO_OWNER_STATE, KVMemory, OwnerRecord,
                                            kv_memory_from_stats, owner_risk)

LATENCY_WINDOW = 1000  # requests whose latency makes the p99
MIN_P99_S = 0.5


@dataclass(frozen=True)
class RequestTags:
    """The ids a request carries through logs, events and owners."""

    request_id: str  # the client's x-request-id (or the one the server made up)
    tenant: str
    trace_id: str | None = None  # from a W3C traceparent header


@dataclass
class _Entry:
    tags: RequestTags
    arrival_s: float  # time.monotonic()
    finished_s: float | None = None
    is_scheduled: bool = False


@dataclass(frozen=True)
class MemoryView:
    """What the engine thread publishes for /debug/memory: the pool and its owners, dated."""

    time: float  # time.time() when it was taken
    kv: KVMemory
    owners: tuple[OwnerRecord, ...]


def memory_view(engine, stats, book: "OwnerBook") -> MemoryView:
    """The pool (from `stats`, the EngineStats just published) and its owners, now."""
    holders = engine.kv_holders()
    kv = kv_memory_from_stats(stats.kv, engine.runner.layout.page_bytes, holders.host_swap_bytes,
                              weights_planned_bytes=engine.weights_plan[0])
    return MemoryView(time.time(), kv, book.owners(holders))


class OwnerBook:
    """Tags and times of the engine's choices; used on the engine thread only."""

    def __init__(self, model: str, clock=time.monotonic):
        self.model, self._clock = model, clock
        self._entries: dict[str, _Entry] = {}
        self._latencies_s: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def admit(self, engine_request_id: str, tags: RequestTags, arrival_s: float | None = None) -> None:
        """A choice the engine accepted."""
        self._entries[engine_request_id] = _Entry(tags, self._clock() if arrival_s is None else arrival_s)

    def finish(self, engine_request_id: str) -> None:
        """A choice's last output went out: date it and record its latency."""
        entry = self._entries.get(engine_request_id)
        if entry is not None and entry.finished_s is None:
            entry.finished_s = self._clock()
            self._latencies_s.append(entry.finished_s - entry.arrival_s)

    def first_schedule(self, engine_request_id: str) -> bool:
        """True the first time a choice is scheduled (its `schedule` event), False after."""
        entry = self._entries.get(engine_request_id)
        if entry is None or entry.is_scheduled:
            return False
        entry.is_scheduled = True
        return True

    def tags_of(self, engine_request_id: str) -> RequestTags | None:
        """The tags of a choice still remembered."""
        entry = self._entries.get(engine_request_id)
        return entry.tags if entry is not None else None

    @property
    def p99_latency_s(self) -> float:
        """p99 of the recent request latencies (at least MIN_P99_S)."""
        if not self._latencies_s:
            return MIN_P99_S
        ordered = sorted(self._latencies_s)
        return max(MIN_P99_S, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])

    def owners(self, holders) -> tuple[OwnerRecord, ...]:
        """One record per holder of `holders` (engine.holders.KVHolders), orphans last."""
        now, p99 = self._clock(), self.p99_latency_s
        out = [self._record(h, now, p99) for h in holders.holders]
        if holders.num_orphan_blocks:
            out.append(OwnerRecord(None, None, holders.num_orphan_blocks, 0.0, NO_OWNER_STATE,
                                   owner_risk(NO_OWNER_STATE, 0.0, p99), model=self.model))
        holding = {h.seq_id for h in holders.holders}
        for rid in [rid for rid, e in self._entries.items() if e.finished_s is not None and rid not in holding]:
            del self._entries[rid]
        return tuple(out)

    def _record(self, holder, now: float, p99: float) -> OwnerRecord:
        entry = self._entries.get(holder.seq_id)
        if holder.state in LIVE_STATES:
            state = holder.state
        else:  # finished (or forgotten by the engine): ours if we have its tags
            state = FINISHED_STATE if entry is not None else NO_OWNER_STATE
        if entry is None:
            return OwnerRecord(None, None, holder.num_blocks, 0.0, state, owner_risk(state, 0.0, p99),
                               model=self.model, engine_request_id=holder.seq_id)
        since = (entry.finished_s or now) if state == FINISHED_STATE else entry.arrival_s
        age_s = now - since
        return OwnerRecord(entry.tags.request_id, entry.tags.tenant, holder.num_blocks, age_s, state,
                           owner_risk(state, age_s, p99), entry.tags.trace_id, self.model, holder.seq_id)
