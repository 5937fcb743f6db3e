"""KV stats: the numbers the CLI, /metrics and diagnostics render (returned, never printed).

Two fragmentation figures, because they answer different questions
(docs/kv-block-manager.md says which one costs capacity):

- internal waste = allocated slots not holding a token / allocated slots. A sequence's last
  block in each group is partly empty; nothing else can use those slots.
- external fragmentation = 1 - largest contiguous run of allocatable blocks / allocatable
  blocks (free + evictable). 0 when the allocatable blocks form one run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

from ctxwarden.kv.audit import AuditFinding, SequenceBlocks


@dataclass(frozen=True)
class FragmentationStats:
    """Internal waste inside allocated blocks and external fragmentation of the free blocks."""

    num_allocated_slots: int  # in-use blocks x block_size
    num_wasted_slots: int  # allocated slots that hold no token
    num_allocatable_blocks: int  # free + evictable
    largest_free_run_blocks: int  # longest run of consecutive allocatable block ids

    @property
    def internal_waste(self) -> float:
        """Wasted slots over allocated slots (0.0 when nothing is allocated)."""
        return self.num_wasted_slots / self.num_allocated_slots if self.num_allocated_slots else 0.0

    @property
    def external_fragmentation(self) -> float:
        """1 - largest free run / allocatable blocks (0.0 when nothing is allocatable)."""
        if not self.num_allocatable_blocks:
            return 0.0
        return 1.0 - self.largest_free_run_blocks / self.num_allocatable_blocks


@dataclass(frozen=True)
class KVStats:
    """Every number the KV manager reports. `cached` means evictable-cached (ref 0)."""

    block_size: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_blocks_cached: int
    num_blocks_free: int
    num_sequences: int
    num_prefix_queries: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_evictions: int
    num_cross_namespace_hits: int  # must stay 0: a hit on another namespace's block
    fragmentation: FragmentationStats
    audit_findings: tuple[AuditFinding, ...]

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 before any query)."""
        if not self.num_prefix_query_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    def to_dict(self) -> dict:
        """A JSON-ready dict with the derived ratios included."""
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        d["fragmentation"]["internal_waste"] = self.fragmentation.internal_waste
        d["fragmentation"]["external_fragmentation"] = self.fragmentation.external_fragmentation
        d["audit_findings"] = [
            {"kind": f.kind, "message": f.message, "block_id": f.block_id,
             "seq_id": repr(f.seq_id) if f.seq_id is not None else None}
            for f in self.audit_findings]
        return d


def largest_run(flags: Iterable[bool]) -> int:
    """Length of the longest run of True values."""
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def fragmentation(ref_counts: list[int], block_size: int,
                  sequences: Iterable[SequenceBlocks], num_groups: int) -> FragmentationStats:
    """Fragmentation of a pool given its ref counts and the sequences holding blocks.

    Only a sequence's last block in each group can be partly filled (shared blocks are
    full: only full blocks are cached), so the waste is (-num_tokens) % block_size per group.
    """
    num_in_use = len(ref_counts) - ref_counts.count(0)
    wasted = sum(num_groups * (-seq.num_tokens % block_size) for seq in sequences)
    return FragmentationStats(
        num_allocated_slots=num_in_use * block_size,
        num_wasted_slots=wasted,
        num_allocatable_blocks=len(ref_counts) - num_in_use,
        largest_free_run_blocks=largest_run(r == 0 for r in ref_counts),
    )
