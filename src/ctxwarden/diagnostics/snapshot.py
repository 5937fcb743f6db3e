"""A memory snapshot: process, cgroup, KV pool and KV owners, as one JSON-ready object.

`ctxwarden diag mem snapshot --json` prints `MemorySnapshot.to_dict()`:

    {"schema_version": 1, "time": unix s, "process": {...}, "cgroup": {...} | null,
     "kv": {...} | null, "owners": [{"request_id", "tenant", "blocks", "age_s", "state",
     "risk"}], "notes": [why a section is missing or partial]}

`kv` and `owners` come from a running engine (the server's /debug/memory); a snapshot of a
plain process has `kv: null` and no owners. Owner risk by age: a live owner (running,
waiting, swapped) is OK; a finished owner still holding blocks is OK until 2x the p99
request latency has passed since it finished, then HIGH; blocks with no owner are CRITICAL.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ctxwarden.diagnostics.cgroup import DEFAULT_CGROUP_ROOT, CgroupMemory, lookup_cgroup
from ctxwarden.diagnostics.process_memory import ProcessMemory, read_process_memory

SCHEMA_VERSION = 1
RISK_OK, RISK_HIGH, RISK_CRITICAL = "OK", "HIGH", "CRITICAL"
LIVE_STATES = ("running", "waiting", "swapped")
FINISHED_STATE, NO_OWNER_STATE = "finished", "none"
HIGH_RISK_LATENCY_FACTOR = 2.0


@dataclass(frozen=True)
class KVMemory:
    """The KV pool in blocks and bytes (every block is `page_bytes`: docs/architecture.md)."""

    block_size: int
    page_bytes: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_blocks_cached: int  # evictable: content kept for prefix hits, reusable at once
    num_blocks_free: int
    internal_waste: float
    external_fragmentation: float
    host_swap_bytes: int  # preempted sequences' pages held in host memory
    weights_planned_bytes: int | None
    weights_mapped_bytes: int | None

    def to_dict(self) -> dict:
        """JSON-ready, with the block counts also in bytes."""
        extra = {f"{k}_bytes": getattr(self, f"num_blocks_{k}") * self.page_bytes
                 for k in ("total", "in_use", "cached", "free")}
        return {**asdict(self), **extra}


def kv_memory_from_stats(stats, page_bytes: int, host_swap_bytes: int = 0,
                         weights_planned_bytes: int | None = None,
                         weights_mapped_bytes: int | None = None) -> KVMemory:
    """Build the snapshot's KV section from the KV manager's `KVStats` (ctxwarden.kv.stats)."""
    frag = stats.fragmentation
    return KVMemory(block_size=stats.block_size, page_bytes=page_bytes, num_blocks_total=stats.num_blocks_total,
                    num_blocks_in_use=stats.num_blocks_in_use, num_blocks_cached=stats.num_blocks_cached,
                    num_blocks_free=stats.num_blocks_free, internal_waste=frag.internal_waste,
                    external_fragmentation=frag.external_fragmentation, host_swap_bytes=host_swap_bytes,
                    weights_planned_bytes=weights_planned_bytes, weights_mapped_bytes=weights_mapped_bytes)


@dataclass(frozen=True)
class OwnerRecord:
    """Blocks held by one owner (a request), with its age and risk."""

    request_id: str | None  # None: blocks that no request owns
    tenant: str | None
    blocks: int
    age_s: float  # since arrival (live owners) or since finishing (finished owners)
    state: str  # running | waiting | swapped | finished | none
    risk: str  # OK | HIGH | CRITICAL
    trace_id: str | None = None  # the W3C traceparent's trace id, when the client sent one
    model: str | None = None  # the served model whose pool holds the blocks
    engine_request_id: str | None = None  # the engine's id of this choice (one per choice)


def owner_risk(state: str, age_s: float, p99_latency_s: float) -> str:
    """OK for live owners and recently finished ones; HIGH past 2x p99 latency; CRITICAL unowned."""
    if state in LIVE_STATES:
        return RISK_OK
    if state == NO_OWNER_STATE:
        return RISK_CRITICAL
    if state != FINISHED_STATE:
        raise ValueError(f"owner state must be one of {LIVE_STATES + (FINISHED_STATE, NO_OWNER_STATE)}, "
                         f"got {state!r}")
    return RISK_HIGH if age_s > HIGH_RISK_LATENCY_FACTOR * p99_latency_s else RISK_OK


@dataclass(frozen=True)
class MemorySnapshot:
    """Everything `diag mem snapshot` reports (module doc)."""

    time: float
    process: ProcessMemory
    cgroup: CgroupMemory | None
    kv: KVMemory | None = None
    owners: tuple[OwnerRecord, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        """The stable JSON object (docs/diagnostics.md)."""
        return {"schema_version": SCHEMA_VERSION, "time": self.time, "process": self.process.to_dict(),
                "cgroup": self.cgroup.to_dict() if self.cgroup else None,
                "kv": self.kv.to_dict() if self.kv else None,
                "owners": [asdict(o) for o in self.owners], "notes": list(self.notes)}


def take_snapshot(pid: int | None = None, cgroup_root: str = DEFAULT_CGROUP_ROOT) -> MemorySnapshot:
    """Snapshot a process (default: this one) and its memory cgroup; no engine sections."""
    process = read_process_memory(pid)
    found = lookup_cgroup(process.pid, cgroup_root)
    notes = [found.reason] if found.reason else []
    notes.append("kv and owners: read by pid, only the process and its cgroup are visible "
                 "(the engine's KV pool and its owners are reported by the server itself)")
    if process.uss_bytes is None:
        notes.append(f"uss/pss: /proc/{process.pid}/smaps_rollup is not readable (another user's process)")
    return MemorySnapshot(time=time.time(), process=process, cgroup=found.memory, notes=tuple(notes))
