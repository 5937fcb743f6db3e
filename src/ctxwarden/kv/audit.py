"""The KV audit: recount the pool from scratch and prove its invariants, or name the breach.

What it checks (each breach is one AuditFinding, never an exception, so a report can list
every problem at once):

- identity: free + evictable-cached + in-use == total, with in-use recounted from the ref
  counts (not read from the pool's own counter), and the three sets disjoint;
- ownership: every block's ref count equals the number of block-table entries naming it; no
  sequence names a block twice; a block held by two owners carries cached content (sharing
  happens only through prefix hits); every in-use block has an owner;
- liveness: every owner is a sequence the engine says is live. A block of a finished owner
  is a leak, ranked by how long ago the owner finished (or, unknown, last touched it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping

from ctxwarden.kv.block_pool import BlockPool

IDENTITY = "identity"
BAD_FREE_LIST = "bad_free_list"
CACHE_MAP_MISMATCH = "cache_map_mismatch"
REF_COUNT_MISMATCH = "ref_count_mismatch"
OWNED_TWICE = "owned_twice"
SHARED_UNCACHED = "shared_uncached"
ORPHAN = "orphan"
LEAK = "leak"

RISK_LIVE, RISK_LOW, RISK_MEDIUM, RISK_HIGH = "live", "low", "medium", "high"


@dataclass(frozen=True)
class RiskThresholds:
    """How long after its owner finished a held block is a low, medium or high risk leak."""

    low_below_ms: float = 100.0
    high_above_ms: float = 5000.0

    def __post_init__(self):
        if not 0 <= self.low_below_ms <= self.high_above_ms:
            raise ValueError(
                f"risk thresholds need 0 <= low_below_ms <= high_above_ms, got "
                f"{self.low_below_ms} and {self.high_above_ms}")

    def level(self, idle_ms: float) -> str:
        """low below `low_below_ms`, high above `high_above_ms`, medium between."""
        if idle_ms < self.low_below_ms:
            return RISK_LOW
        return RISK_HIGH if idle_ms > self.high_above_ms else RISK_MEDIUM


@dataclass(frozen=True)
class SequenceBlocks:
    """What one sequence holds, as the manager hands it to the audit and to stats."""

    seq_id: Hashable
    namespace: str
    num_tokens: int
    block_tables: tuple[tuple[int | None, ...], ...]  # one per layer group
    touched_ns: int

    def held_block_ids(self) -> list[int]:
        """Every block id the sequence holds, over all groups."""
        return [b for table in self.block_tables for b in table if b is not None]


@dataclass(frozen=True)
class AuditFinding:
    """One broken invariant: its kind (a module constant), a sentence, and what it names."""

    kind: str
    message: str
    block_id: int | None = None
    seq_id: Hashable | None = None


@dataclass(frozen=True)
class OwnerReport:
    """The blocks one owner holds, how long since it touched them, and the leak risk."""

    seq_id: Hashable
    namespace: str
    is_live: bool
    block_ids: tuple[int, ...]
    age_ms: float  # since the owner last allocated, hit or appended
    idle_ms: float  # since the owner finished (age_ms when the finish time is unknown)
    risk: str  # live | low | medium | high

    @property
    def num_blocks(self) -> int:
        """Blocks this owner holds over every group."""
        return len(self.block_ids)


@dataclass(frozen=True)
class AuditReport:
    """The recounted pool, every finding, and every owner's blocks."""

    num_blocks_total: int
    num_blocks_free: int
    num_blocks_evictable: int
    num_blocks_in_use: int
    findings: tuple[AuditFinding, ...]
    owners: tuple[OwnerReport, ...] = field(default=())

    @property
    def identity_holds(self) -> bool:
        """free + evictable-cached + in-use == total (recounted)."""
        return (self.num_blocks_free + self.num_blocks_evictable + self.num_blocks_in_use
                == self.num_blocks_total)

    @property
    def is_clean(self) -> bool:
        """No finding of any kind."""
        return not self.findings

    def findings_of(self, kind: str) -> list[AuditFinding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind == kind]


def run_audit(pool: BlockPool, sequences: Iterable[SequenceBlocks],
              live_seq_ids: Iterable[Hashable] | None = None,
              finished_at_ns: Mapping[Hashable, int] | None = None,
              thresholds: RiskThresholds = RiskThresholds()) -> AuditReport:
    """Audit `pool` against the block tables of `sequences`.

    `live_seq_ids` is the engine's own list of running sequences; None trusts the manager
    (every sequence it holds is live), which checks structure but cannot see leaks.
    """
    sequences = list(sequences)
    refs = pool.ref_counts()
    free, evictable = pool.free_block_ids(), pool.evictable_block_ids()
    num_in_use = len(refs) - refs.count(0)
    findings = _check_lists(pool, refs, free, evictable, num_in_use)
    findings += _check_ownership(pool, refs, sequences)
    live = None if live_seq_ids is None else set(live_seq_ids)
    owners, leaks = _owner_reports(pool, sequences, live, finished_at_ns or {}, thresholds)
    return AuditReport(pool.num_blocks, len(free), len(evictable), num_in_use,
                       tuple(findings + leaks), tuple(owners))


def _check_lists(pool: BlockPool, refs: list[int], free: list[int], evictable: list[int],
                 num_in_use: int) -> list[AuditFinding]:
    out = []
    if len(free) + len(evictable) + num_in_use != pool.num_blocks:
        out.append(AuditFinding(IDENTITY, (
            f"free {len(free)} + evictable {len(evictable)} + in use {num_in_use} != total "
            f"{pool.num_blocks}")))
    for b, n in Counter(free + evictable).items():
        if n > 1:
            out.append(AuditFinding(BAD_FREE_LIST, f"block {b} is listed {n} times", b))
    for b in free + evictable:
        if refs[b]:
            out.append(AuditFinding(BAD_FREE_LIST, f"block {b} is listed free but has "
                                    f"{refs[b]} owners", b))
    for b in evictable:
        if pool.key_of(b) is None:
            out.append(AuditFinding(BAD_FREE_LIST, f"evictable block {b} has no content", b))
    for b in free:
        if pool.key_of(b) is not None:
            out.append(AuditFinding(BAD_FREE_LIST, f"free block {b} still has a cache key", b))
    for key, b in pool.cached_items():
        if pool.key_of(b) != key:
            out.append(AuditFinding(CACHE_MAP_MISMATCH, f"the cache maps a key to block {b}, "
                                    f"which holds another", b))
    return out


def _check_ownership(pool: BlockPool, refs: list[int],
                     sequences: list[SequenceBlocks]) -> list[AuditFinding]:
    out, owners = [], Counter()
    for seq in sequences:
        held = seq.held_block_ids()
        for b, n in Counter(held).items():
            if n > 1:
                out.append(AuditFinding(OWNED_TWICE, f"sequence {seq.seq_id!r} names block "
                                        f"{b} {n} times", b, seq.seq_id))
        owners.update(held)
    for b, n in owners.items():
        if refs[b] != n:
            out.append(AuditFinding(REF_COUNT_MISMATCH, f"block {b} has ref count {refs[b]} "
                                    f"but {n} table entries", b))
        if n > 1 and pool.key_of(b) is None:
            out.append(AuditFinding(SHARED_UNCACHED, f"block {b} is held by {n} owners "
                                    f"without cached content", b))
    for b, r in enumerate(refs):
        if r and b not in owners:
            out.append(AuditFinding(ORPHAN, f"block {b} is in use (ref {r}) but no sequence "
                                    f"holds it", b))
    return out


def _owner_reports(pool: BlockPool, sequences: list[SequenceBlocks], live: set | None,
                   finished_at_ns: Mapping[Hashable, int], thresholds: RiskThresholds):
    now = pool.now_ns()
    owners, leaks = [], []
    for seq in sequences:
        is_live = live is None or seq.seq_id in live
        age_ms = (now - seq.touched_ns) / 1e6
        idle_ms = (now - finished_at_ns[seq.seq_id]) / 1e6 if seq.seq_id in finished_at_ns \
            else age_ms
        risk = RISK_LIVE if is_live else thresholds.level(idle_ms)
        ids = tuple(seq.held_block_ids())
        owners.append(OwnerReport(seq.seq_id, seq.namespace, is_live, ids, age_ms,
                                  idle_ms if not is_live else 0.0, risk))
        if not is_live:
            leaks.append(AuditFinding(LEAK, (
                f"sequence {seq.seq_id!r} is not live but holds {len(ids)} blocks "
                f"(idle {idle_ms:.0f} ms, risk {risk}); free it"), None, seq.seq_id))
    return owners, leaks
