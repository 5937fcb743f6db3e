"""Paged KV block manager (pure Python, no torch): the pool, block tables, prefix cache, audit.

- `block_pool`: BlockPool, ref counts, free stack + evictable LRU, the cache-key map.
- `block_table`: BlockTable per sequence and group, the sliding-window release rule.
- `prefix`: the salted BLAKE2b hash chain over full blocks.
- `manager`: KVCacheManager, the engine's interface (allocate / append / free / tables).
- `audit`, `stats`: invariants and numbers, returned as objects.

Admission arithmetic (blocks_needed) lives in ctxwarden.plan.kv; this package uses it,
never re-derives it. See docs/kv-block-manager.md.
"""

from ctxwarden.kv.audit import (AuditFinding, AuditReport, OwnerReport, RiskThresholds,
                                SequenceBlocks, run_audit)
from ctxwarden.kv.block_pool import BlockPool
from ctxwarden.kv.block_table import BlockTable, BlockTables, first_needed_block
from ctxwarden.kv.manager import KVAllocation, KVCacheManager, PrefixHit
from ctxwarden.kv.prefix import extend_chain, hash_block, root_hash
from ctxwarden.kv.stats import FragmentationStats, KVStats, fragmentation

__all__ = [
    "AuditFinding", "AuditReport", "BlockPool", "BlockTable", "BlockTables", "FragmentationStats",
    "KVAllocation", "KVCacheManager", "KVStats", "OwnerReport", "PrefixHit", "RiskThresholds",
    "SequenceBlocks", "extend_chain", "first_needed_block", "fragmentation", "hash_block",
    "root_hash", "run_audit",
]
