"""The KV cache manager: block tables per sequence over one shared block pool.

The engine's whole contract with KV memory:

    can_allocate(prompt) / allocate(seq, prompt)  -> KVAllocation (tokens hit in the cache)
    commit_fetched(seq)                           -> blocks filled from a tier join the cache
    drain_evicted()                               -> blocks evicted since the last call (spills)
    can_append(seq, n)   / append(seq, tokens)    -> slots for new tokens (windows roll)
    block_tables(seq)                             -> what the runner reads and writes
    free(seq)                                     -> released in this call
    stats(), audit(live)                          -> KVStats, AuditReport

A sequence holds one BlockTable per layer group of the KVLayout; all groups draw from one
BlockPool because every page has the same size. Prefix caching: each full block gets a
hash-chain key (ctxwarden.kv.prefix) per group, salted by the namespace (tenant); a new
prompt reuses the longest run of cached blocks that every group can serve, capped so the
last prompt token is always computed (its logits are the first sample).

Algorithm of allocate: hash the prompt's full blocks -> find the longest hit -> take a
reference on the hit blocks (before allocating, so the allocation cannot evict them) ->
allocate blocks for the new tokens -> register every newly full block in the cache.

Blocks fetched from a KV tier (`num_fetched_blocks`) are allocated like new ones and count
as computed, but join the prefix cache only at `commit_fetched`, which the scheduler calls
once the engine has written their verified bytes into the pool: nothing can hit a page
before its bytes are in place.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence

from ctxwarden.errors import (DoubleFree, KVPoolExhausted, SequenceExists, UnknownSequence,
                              UseAfterFree)
from ctxwarden.kv.audit import AuditReport, RiskThresholds, SequenceBlocks, run_audit
from ctxwarden.kv.block_pool import BlockPool
from ctxwarden.kv.block_table import BlockTable, first_needed_block
from ctxwarden.kv.prefix import BlockHash, extend_chain, root_hash
from ctxwarden.kv.stats import KVStats, fragmentation
from ctxwarden.plan.kv import KVLayout

_FREED_HISTORY = 1 << 16  # freed ids remembered to tell a double free from an unknown id


@dataclass(frozen=True)
class KVAllocation:
    """What `allocate` did: tokens found in the cache, tokens given slots, blocks taken."""

    seq_id: Hashable
    num_computed_tokens: int  # prefix hit: KV already in the pool, do not recompute
    num_new_tokens: int  # tokens given slots now (to compute this step)
    num_new_blocks: int  # blocks taken from the pool, over every group
    num_hit_blocks: int  # cached blocks shared, over every group
    num_fetched_blocks: int = 0  # logical blocks to be filled from a tier (computed, not cached yet)


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block the pool evicted: its page (still holding the bytes until the next
    forward writes it) and what identifies its content, for a spill to a tier."""

    page_id: int
    group_index: int
    block_index: int
    block_hash: BlockHash
    parent_hash: BlockHash
    root: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrefixHit:
    """A read-only prefix lookup: how much of a prompt the cache already holds."""

    num_prompt_tokens: int
    num_computed_tokens: int
    num_new_blocks_needed: int  # to give every prompt token a slot
    num_blocks_revived: int  # hit blocks now evictable (allocation takes them off the list)


@dataclass
class _Draft:
    """An allocation worked out but not yet taken: the chain, the hits, what is new."""

    chain: list[BlockHash]
    root: BlockHash
    hit_tables: list[list[int | None]]
    num_hit_blocks: int  # logical blocks (per group)
    num_fetched_blocks: int
    num_new_tokens: int
    num_new_blocks: int
    num_revived: int


class _Sequence:
    __slots__ = ("seq_id", "namespace", "root", "token_ids", "num_tokens", "tables", "chain",
                 "num_registered_blocks", "num_shared_blocks", "touched_ns", "fetched")

    def __init__(self, seq_id, namespace, root, token_ids, tables, chain, now_ns):
        self.seq_id, self.namespace, self.root = seq_id, namespace, root
        self.token_ids: list[int] = token_ids  # every token known (slotted or not yet)
        self.num_tokens = 0  # tokens with a slot
        self.tables: list[BlockTable] = tables
        self.chain: list[BlockHash] = chain  # hash of full block j (when caching is on)
        self.num_registered_blocks = 0
        self.num_shared_blocks: int | None = None  # None: every full block joins the cache
        self.touched_ns = now_ns
        self.fetched: range = range(0)  # logical blocks filled from a tier, not yet cached


class KVCacheManager:
    """Paged KV block manager for one KVLayout and a pool of `num_blocks` pages."""

    def __init__(self, layout: KVLayout, num_blocks: int, enable_prefix_caching: bool = True,
                 clock_ns: Callable[[], int] = time.monotonic_ns,
                 risk_thresholds: RiskThresholds = RiskThresholds(), record_evictions: bool = False):
        self.layout = layout
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.risk_thresholds = risk_thresholds
        self.pool = BlockPool(num_blocks, layout.block_size, clock_ns)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        # The namespace whose tokens a cached block holds: checked on every hit, so a hash
        # collision across tenants would be counted (and refused), not served.
        self._block_namespace: list[str | None] = [None] * num_blocks
        self.num_prefix_queries = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_cross_namespace_hits = 0
        # What a cached block holds (root, index, parent, tokens), kept only to spill it on
        # eviction (a RAM tier is configured): the pool itself knows ids and keys only.
        self._block_meta: dict[int, tuple] | None = {} if record_evictions else None
        self._evicted: list[EvictedBlock] = []
        if record_evictions:
            self.pool.on_evict = self._on_evict

    # --- allocate ---------------------------------------------------------------------

    def find_prefix(self, token_ids: Sequence[int], namespace: str = "",
                    extra_keys: Sequence[str | bytes | int] = (), read_cache: bool = True,
                    shared_tokens: int | None = None) -> PrefixHit:
        """How many of the prompt's tokens the cache holds, changing nothing (no counters)."""
        draft = self._draft(token_ids, namespace, extra_keys, None, read_cache, shared_tokens=shared_tokens)
        return PrefixHit(len(token_ids), draft.num_hit_blocks * self.block_size,
                         draft.num_new_blocks, draft.num_revived)

    def can_allocate(self, token_ids: Sequence[int], namespace: str = "",
                     extra_keys: Sequence[str | bytes | int] = (),
                     max_num_new_tokens: int | None = None, read_cache: bool = True,
                     num_fetched_blocks: int = 0, shared_tokens: int | None = None) -> bool:
        """Whether `allocate` with the same arguments would succeed now."""
        draft = self._draft(token_ids, namespace, extra_keys, max_num_new_tokens, read_cache,
                            num_fetched_blocks, shared_tokens)
        return draft.num_new_blocks + draft.num_revived <= self.pool.num_available_blocks

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], namespace: str = "",
                 extra_keys: Sequence[str | bytes | int] = (),
                 max_num_new_tokens: int | None = None, read_cache: bool = True,
                 num_fetched_blocks: int = 0, shared_tokens: int | None = None) -> KVAllocation:
        """Register a sequence with its prompt; share its cached prefix; slot the rest.

        Slots go to the hit tokens plus at most `max_num_new_tokens` more (default: the
        whole prompt); chunked prefill slots the remaining prompt tokens with `append`.
        `read_cache=False` takes no hit (every token is computed, e.g. to score the whole
        prompt) while the sequence's full blocks are still registered for others to hit.
        `num_fetched_blocks` blocks after the hit are given pages and count as computed: a
        tier fills them, then `commit_fetched` caches them. `shared_tokens` (None: all)
        bounds the sharing both ways: only full blocks within the first `shared_tokens`
        tokens are looked up, and only those are ever registered for others (the engine
        passes the prompt's length when generated tokens' KV differs from a prompt's).
        Raises SequenceExists, or KVPoolExhausted (changing nothing) when it does not fit.
        """
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already holds KV blocks; free it first")
        draft = self._draft(token_ids, namespace, extra_keys, max_num_new_tokens, read_cache,
                            num_fetched_blocks, shared_tokens)
        needed = draft.num_new_blocks + draft.num_revived
        if needed > self.pool.num_available_blocks:
            raise KVPoolExhausted(needed, self.pool.num_available_blocks, self.pool.num_blocks)
        if read_cache:
            self._count_query(len(token_ids), draft.num_hit_blocks * self.block_size)
        hit_ids = [b for table in draft.hit_tables for b in table if b is not None]
        self.pool.touch(hit_ids)  # before allocating: the allocation must not evict them
        seq = self._new_sequence(seq_id, namespace, draft, token_ids)
        if shared_tokens is not None:
            seq.num_shared_blocks = shared_tokens // self.block_size
        seq.num_tokens = draft.num_hit_blocks * self.block_size
        seq.num_registered_blocks = draft.num_hit_blocks
        num_computed_blocks = draft.num_hit_blocks + draft.num_fetched_blocks
        seq.fetched = range(draft.num_hit_blocks, num_computed_blocks)
        num_new_blocks = self._grow(seq, num_computed_blocks * self.block_size + draft.num_new_tokens)
        return KVAllocation(seq_id, num_computed_blocks * self.block_size, draft.num_new_tokens,
                            num_new_blocks, len(hit_ids), draft.num_fetched_blocks)

    def commit_fetched(self, seq_id: Hashable) -> int:
        """Cache the blocks a tier filled (their bytes are now in the pool); how many."""
        seq = self._live(seq_id)
        fetched, seq.fetched = seq.fetched, range(0)
        for j in fetched:
            self._register(seq, j)
        return len(fetched)

    def _new_sequence(self, seq_id, namespace, draft: _Draft, token_ids) -> _Sequence:
        tables = [BlockTable(self.block_size, g.window_tokens, self.layout.sink_tokens, ids)
                  for g, ids in zip(self.layout.groups, draft.hit_tables)]
        seq = _Sequence(seq_id, namespace, draft.root, list(token_ids), tables, draft.chain,
                        self.pool.now_ns())
        self._seqs[seq_id] = seq
        self._freed.pop(seq_id, None)  # an id may come back (recompute after preemption)
        return seq

    def _count_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_prefix_queries += 1
            self.num_prefix_query_tokens += num_prompt_tokens
            self.num_prefix_hit_tokens += num_hit_tokens

    # --- the prefix lookup --------------------------------------------------------------

    def _draft(self, token_ids, namespace, extra_keys, max_num_new_tokens, read_cache=True,
               num_fetched_blocks: int = 0, shared_tokens: int | None = None) -> _Draft:
        """What `allocate` would do (hash chain, hits, blocks to take), changing nothing."""
        if len(token_ids) < 1:
            raise ValueError("a sequence needs at least 1 prompt token, got 0")
        if max_num_new_tokens is not None and max_num_new_tokens < 1:
            raise ValueError(f"max_num_new_tokens must be >= 1, got {max_num_new_tokens}")
        bs, num_groups = self.block_size, self.layout.num_groups
        chain: list[BlockHash] = []
        root = b""
        hit_tables: list[list[int | None]] = [[] for _ in range(num_groups)]
        if self.enable_prefix_caching:
            root = root_hash(namespace, tuple(extra_keys))
            extend_chain(chain, root, token_ids, bs, len(token_ids) // bs)
            if read_cache:
                most = (len(token_ids) - 1) // bs
                if shared_tokens is not None:
                    most = min(most, shared_tokens // bs)
                hit_tables = self._longest_hit(chain[:most], namespace)
        num_hit = len(hit_tables[0])
        self._check_fetch(num_hit, num_fetched_blocks, len(token_ids))
        num_computed = (num_hit + num_fetched_blocks) * bs
        num_new = len(token_ids) - num_computed
        if max_num_new_tokens is not None:
            num_new = min(num_new, max_num_new_tokens)
        num_new_blocks = num_groups * (-(-(num_computed + num_new) // bs) - num_hit)
        revived = sum(1 for t in hit_tables for b in t
                      if b is not None and self.pool.ref_count(b) == 0)
        return _Draft(chain, root, hit_tables, num_hit, num_fetched_blocks, num_new, num_new_blocks, revived)

    def _check_fetch(self, num_hit: int, num_fetched: int, num_tokens: int) -> None:
        if not num_fetched:
            return
        if any(g.window_tokens is not None for g in self.layout.groups):
            raise ValueError("blocks fetched from a tier need full-attention layers only; this "
                             "layout has sliding groups")
        most = (num_tokens - 1) // self.block_size - num_hit  # the last token is always computed
        if not 0 < num_fetched <= most:
            raise ValueError(f"num_fetched_blocks must be in [0, {most}] (full prompt blocks after "
                             f"the {num_hit}-block hit, the last token excluded), got {num_fetched}")

    def _longest_hit(self, chain: list[BlockHash], namespace: str) -> list[list[int | None]]:
        """Per-group hit tables for the largest k every group can serve.

        A full group serves k blocks iff blocks 0..k-1 are all cached. A sliding group
        needs only what a step starting at token k*bs reads: its sink blocks and the blocks
        from first_needed_block(k*bs) to k-1; the rest of its table stays None.
        """
        k = len(chain)
        found = []
        for g, group in enumerate(self.layout.groups):
            ids = self._lookup_run(g, chain[:k]) if group.window_tokens is None else \
                [self.pool.lookup((g, h)) for h in chain]
            k = min(k, len(ids)) if group.window_tokens is None else k
            found.append(ids)
        runs = [_runs_ending_at(ids) for ids in found]
        while k > 0 and not all(self._group_serves(g, found[g], runs[g], k)
                                for g in range(self.layout.num_groups)):
            k -= 1
        tables = [self._hit_table(g, found[g], k) for g in range(self.layout.num_groups)]
        if any(self._block_namespace[b] != namespace for t in tables for b in t if b is not None):
            self.num_cross_namespace_hits += 1  # never served: treat it as a miss
            return [[] for _ in tables]
        return tables

    def _lookup_run(self, g: int, chain: list[BlockHash]) -> list[int | None]:
        """Cached blocks of a full group up to the first miss (a full group can use no more)."""
        ids, lookup = [], self.pool.lookup
        for h in chain:
            b = lookup((g, h))
            if b is None:
                break
            ids.append(b)
        return ids

    def _group_serves(self, g: int, ids: list[int | None], runs: list[int], k: int) -> bool:
        window = self.layout.groups[g].window_tokens
        if window is None:
            return True  # k is already capped by the leading run
        first = first_needed_block(k * self.block_size, window, self.block_size)
        sinks = min(_sink_blocks(self.layout, self.block_size), k)
        return runs[k - 1] >= k - first and (sinks == 0 or runs[sinks - 1] >= sinks)

    def _hit_table(self, g: int, ids: list[int | None], k: int) -> list[int | None]:
        window = self.layout.groups[g].window_tokens
        if window is None or k == 0:
            return ids[:k]
        first = first_needed_block(k * self.block_size, window, self.block_size)
        sinks = _sink_blocks(self.layout, self.block_size)
        return [b if (j < sinks or j >= first) else None for j, b in enumerate(ids[:k])]

    # --- append -------------------------------------------------------------------------

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Whether `append` of `num_new_tokens` tokens to `seq_id` would succeed now."""
        seq = self._live(seq_id)
        return self._append_shortfall(seq, seq.num_tokens + num_new_tokens) <= 0

    def append(self, seq_id: Hashable, token_ids: Sequence[int] = (),
               num_new_tokens: int | None = None) -> None:
        """Add `token_ids` to the sequence, then give slots to `num_new_tokens` more tokens.

        The default slots every known token (a decode step: append(seq, [sampled])); a
        chunked prefill passes num_new_tokens for the next chunk of the prompt given to
        `allocate`. Sliding groups first release the blocks this step no longer reads.
        Blocks that become full are registered in the prefix cache. Raises UseAfterFree,
        UnknownSequence, or KVPoolExhausted (changing nothing).
        """
        seq = self._live(seq_id)
        num_known = len(seq.token_ids) + len(token_ids)
        num_new = num_known - seq.num_tokens if num_new_tokens is None else num_new_tokens
        if not 0 <= num_new <= num_known - seq.num_tokens:
            raise ValueError(f"num_new_tokens must be in [0, {num_known - seq.num_tokens}] (the "
                             f"known tokens without a slot), got {num_new}")
        shortfall = self._append_shortfall(seq, seq.num_tokens + num_new)
        if shortfall > 0:
            available = self.pool.num_available_blocks
            raise KVPoolExhausted(available + shortfall, available, self.pool.num_blocks)
        seq.token_ids.extend(token_ids)
        for table in seq.tables:
            self.pool.free(table.release(seq.num_tokens))
        self._grow(seq, seq.num_tokens + num_new)

    def _append_shortfall(self, seq: _Sequence, num_tokens_after: int) -> int:
        """Blocks missing for the append: needed minus available after the window release."""
        needed = sum(t.num_blocks_to_grow(num_tokens_after) for t in seq.tables)
        released = sum(1 for t in seq.tables for b in t.releasable_block_ids(seq.num_tokens)
                       if self.pool.ref_count(b) == 1)
        return needed - self.pool.num_available_blocks - released

    def _grow(self, seq: _Sequence, num_tokens_after: int) -> int:
        """Allocate blocks so every table covers `num_tokens_after`; register full blocks."""
        counts = [t.num_blocks_to_grow(num_tokens_after) for t in seq.tables]
        ids = self.pool.allocate(sum(counts))
        start = 0
        for table, n in zip(seq.tables, counts):
            table.block_ids.extend(ids[start:start + n])
            start += n
        seq.num_tokens = num_tokens_after
        seq.touched_ns = self.pool.now_ns()
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)
        return len(ids)

    def _register_full_blocks(self, seq: _Sequence) -> None:
        num_full = seq.num_tokens // self.block_size
        if seq.num_shared_blocks is not None:
            num_full = min(num_full, seq.num_shared_blocks)
        if num_full <= seq.num_registered_blocks:
            return
        extend_chain(seq.chain, seq.root, seq.token_ids, self.block_size, num_full)
        for j in range(seq.num_registered_blocks, num_full):
            if j not in seq.fetched:  # a tier's blocks wait for commit_fetched
                self._register(seq, j)
        seq.num_registered_blocks = num_full

    def _register(self, seq: _Sequence, j: int) -> None:
        """Give logical block j's pages their cache keys (and remember what they hold)."""
        for g, table in enumerate(seq.tables):
            b = table.block_ids[j]
            if b is not None and self.pool.cache_block(b, (g, seq.chain[j])):
                self._block_namespace[b] = seq.namespace
                if self._block_meta is not None:
                    bs = self.block_size
                    parent = seq.chain[j - 1] if j else seq.root
                    self._block_meta[b] = (seq.root, j, parent, tuple(seq.token_ids[j * bs:(j + 1) * bs]))

    # --- free -----------------------------------------------------------------------------

    def free(self, seq_id: Hashable, num_computed_tokens: int | None = None) -> None:
        """Release every block of `seq_id` now. Full blocks stay cached (evictable, LRU).

        Blocks are released tail first, so the tail of the hash chain is evicted before its
        head. After an aborted or failed step pass `num_computed_tokens` (tokens whose K/V
        the runner really wrote): blocks past it lose their cache key instead of offering
        unwritten content to later prompts. Raises DoubleFree for an id freed before,
        UnknownSequence for one never seen.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._raise_not_live(seq_id, "free", DoubleFree)
        if num_computed_tokens is not None:
            self._uncache_unwritten(seq, num_computed_tokens)
        num_logical = len(seq.tables[0].block_ids)
        tail_first = [b for j in range(num_logical - 1, -1, -1) for t in seq.tables
                      if (b := t.block_ids[j]) is not None]
        self.pool.free(tail_first)
        del self._seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_HISTORY:
            self._freed.popitem(last=False)

    def _uncache_unwritten(self, seq: _Sequence, num_computed_tokens: int) -> None:
        first_unwritten = num_computed_tokens // self.block_size
        for table in seq.tables:
            for b in table.block_ids[first_unwritten:]:
                # a block another sequence also holds was a hit: its content was written
                if b is not None and self.pool.ref_count(b) == 1:
                    self.pool.uncache_block(b)

    def _live(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._raise_not_live(seq_id, "use", UseAfterFree)
        return seq

    def _raise_not_live(self, seq_id: Hashable, verb: str, freed_error: type) -> None:
        if seq_id in self._freed:
            raise freed_error(f"sequence {seq_id!r} was already freed; cannot {verb} it again "
                              f"(allocate it anew to recompute)")
        raise UnknownSequence(f"sequence {seq_id!r} was never allocated; call allocate first")

    # --- tiers: chain hashes and evictions -------------------------------------------------

    def root(self, namespace: str = "", extra_keys: Sequence[str | bytes | int] = ()) -> BlockHash:
        """The chain's root for a namespace (the parent of block 0)."""
        return root_hash(namespace, tuple(extra_keys))

    def block_hashes(self, token_ids: Sequence[int], namespace: str = "",
                     extra_keys: Sequence[str | bytes | int] = ()) -> list[BlockHash]:
        """The cache keys (chain hashes) of every full block of `token_ids`."""
        chain: list[BlockHash] = []
        extend_chain(chain, self.root(namespace, extra_keys), token_ids, self.block_size,
                     len(token_ids) // self.block_size)
        return chain

    def _on_evict(self, page_id: int, key) -> None:
        """The pool evicts a cached block: record what it holds now (its page may be reused
        and re-registered within the same scheduling pass)."""
        root, j, parent, tokens = self._block_meta.pop(page_id)
        self._evicted.append(EvictedBlock(page_id, key[0], j, key[1], parent, root, tokens))

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no sequence holds (they spill first when recording)."""
        return self.pool.evict_all_cached()

    def drain_evicted(self) -> list[EvictedBlock]:
        """Blocks evicted since the last call, oldest first (empty unless recording)."""
        out, self._evicted = self._evicted, []
        return out

    # --- what the runner reads -----------------------------------------------------------

    def block_tables(self, seq_id: Hashable) -> tuple[list[int | None], ...]:
        """One list per layer group: logical block j -> block id, None where released."""
        return tuple(list(t.block_ids) for t in self._live(seq_id).tables)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` that have a slot."""
        return self._live(seq_id).num_tokens

    # --- accounting -----------------------------------------------------------------------

    def sequences(self) -> list[SequenceBlocks]:
        """A snapshot of every sequence holding blocks (for the audit, stats, diagnostics)."""
        return [SequenceBlocks(s.seq_id, s.namespace, s.num_tokens,
                               tuple(tuple(t.block_ids) for t in s.tables), s.touched_ns)
                for s in self._seqs.values()]

    def audit(self, live_seq_ids: Iterable[Hashable] | None = None,
              finished_at_ns: Mapping[Hashable, int] | None = None) -> AuditReport:
        """Recount the pool and check every invariant (see ctxwarden.kv.audit).

        Pass the engine's live sequence ids to find leaks; `finished_at_ns` (clock of the
        pool) dates each finished owner's leak for the risk level.
        """
        return run_audit(self.pool, self.sequences(), live_seq_ids, finished_at_ns,
                         self.risk_thresholds)

    def stats(self, run_audit_check: bool = True) -> KVStats:
        """Every counter and gauge of the manager, with fragmentation and audit findings.

        The audit and the fragmentation scan are O(num_blocks); pass run_audit_check=False
        on a hot path to skip the audit (findings are then empty).
        """
        pool, seqs = self.pool, self.sequences()
        findings = self.audit().findings if run_audit_check else ()
        return KVStats(
            self.block_size, pool.num_blocks, pool.num_in_use_blocks, pool.num_evictable_blocks,
            pool.num_free_blocks, len(seqs), self.num_prefix_queries,
            self.num_prefix_query_tokens, self.num_prefix_hit_tokens, pool.num_evictions,
            self.num_cross_namespace_hits,
            fragmentation(pool.ref_counts(), self.block_size, seqs, self.layout.num_groups),
            findings)


def _runs_ending_at(ids: list[int | None]) -> list[int]:
    """runs[j] = how many consecutive found blocks end at index j."""
    runs, run = [], 0
    for b in ids:
        run = run + 1 if b is not None else 0
        runs.append(run)
    return runs


def _sink_blocks(layout: KVLayout, block_size: int) -> int:
    return -(-layout.sink_tokens // block_size)
