"""The block pool: reference counts, the free lists and the prefix-cache map of one KV pool.

A block is in exactly one of three states (the accounting identity is their sum):

    in use      ref_count > 0; owned by one or more block tables
    evictable   ref_count == 0 and cached content (a hash key): kept for prefix hits, LRU
    free        ref_count == 0 and no content: reused first

    allocate(n):  free stack ──pop──▶ in use          (no content lost)
                  evictable LRU head ──evict──▶ in use (only when the free stack is empty)
    free(ids):    in use ──▶ free stack (no key) | evictable LRU tail (key kept)
    touch(ids):   evictable ──▶ in use  (a prefix hit revives a cached block)

Every operation is O(1) per block: the free stack is a Python list (pop/append at the end),
the evictable list an OrderedDict keyed by block id (O(1) removal from the middle when a
hit revives a block, O(1) pop of the least recently used). Callers free a sequence's blocks
tail first, so the tail of a hash chain is evicted before its head: a head is shared by more
prompts (every prompt with that prefix), a tail by fewer.

The pool stores per-block state in flat lists indexed by block id rather than objects, so
the hot loops touch only ints (about 10x fewer allocations than a Block object per id).
No torch here: the runner owns the tensors, this owns the ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Sequence

from ctxwarden.errors import DoubleFree, KVPoolExhausted, UseAfterFree

CacheKey = Hashable  # (group_index, block hash digest) in the manager; opaque here


class BlockPool:
    """`num_blocks` pages of `block_size` tokens with ref counts, free lists and cache keys."""

    def __init__(self, num_blocks: int, block_size: int,
                 clock_ns: Callable[[], int] = time.monotonic_ns):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the pool memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._clock_ns = clock_ns
        self._ref_counts = [0] * num_blocks
        self._keys: list[CacheKey | None] = [None] * num_blocks
        self._touched_ns = [0] * num_blocks
        # A stack whose end is popped: reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._cached: dict[CacheKey, int] = {}
        self._num_in_use = 0
        self.num_evictions = 0
        # called with (block id, key) as a cached block is evicted, while its bytes are
        # intact, by an owner that spills them (the manager, when a RAM tier is configured)
        self.on_evict: Callable[[int, CacheKey], None] | None = None

    # --- counts -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no cached content and no owner (reused first)."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks with no owner whose cached content is kept until evicted (LRU)."""
        return len(self._evictable)

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks with ref_count > 0 (maintained as a counter; the audit recounts)."""
        return self._num_in_use

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take now: free + evictable."""
        return len(self._free) + len(self._evictable)

    # --- allocate / free / touch ----------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks (free ones first, then evict LRU cached ones); ref = 1.

        Raises KVPoolExhausted, changing nothing, when fewer are available.
        """
        if num_blocks > self.num_available_blocks:
            raise KVPoolExhausted(num_blocks, self.num_available_blocks, self.num_blocks)
        free = self._free
        take = min(num_blocks, len(free))
        ids = free[len(free) - take:]
        del free[len(free) - take:]
        ids.reverse()  # the stack's end is its top: hand out in pop order
        for _ in range(num_blocks - take):
            ids.append(self._evict_one())
        now = self._clock_ns()
        refs, touched = self._ref_counts, self._touched_ns
        for b in ids:
            refs[b] = 1
            touched[b] = now
        self._num_in_use += num_blocks
        return ids

    def _evict_one(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block_id, self._keys[block_id])
        del self._cached[self._keys[block_id]]
        self._keys[block_id] = None
        self.num_evictions += 1
        return block_id

    def evict_all_cached(self) -> int:
        """Evict every evictable block (LRU first) to the free list; how many (a cache reset)."""
        n = len(self._evictable)
        for _ in range(n):
            self._free.append(self._evict_one())
        return n

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unowned blocks join the free or evictable list.

        Pass a sequence's blocks tail first: evictable blocks are queued in the order given,
        so the first given is evicted first. Raises DoubleFree for a block whose ref count is
        already 0 (blocks listed before it have been released).
        """
        refs, keys = self._ref_counts, self._keys
        free_append, evictable = self._free.append, self._evictable
        released = 0
        for b in block_ids:
            r = refs[b]
            if r == 0:
                self._num_in_use -= released
                raise DoubleFree(f"block {b} is freed but its ref count is already 0; a block "
                                 f"table listed it twice or it was released before")
            refs[b] = r - 1
            if r == 1:
                released += 1
                if keys[b] is None:
                    free_append(b)
                else:
                    evictable[b] = None
        self._num_in_use -= released

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to cached blocks found by a prefix hit (reviving evictable ones).

        Raises UseAfterFree for a block that is neither in use nor cached: its content is
        gone (evicted or never written), so sharing it would read garbage.
        """
        refs, keys, evictable = self._ref_counts, self._keys, self._evictable
        for b in block_ids:
            if refs[b] == 0 and keys[b] is None:
                raise UseAfterFree(f"block {b} is free with no cached content; it cannot be shared")
        now = self._clock_ns()
        for b in block_ids:
            if refs[b] == 0:
                del evictable[b]
                self._num_in_use += 1
            refs[b] += 1
            self._touched_ns[b] = now

    def mark_touched(self, block_ids: Iterable[int]) -> None:
        """Record `now` as the last use of in-use blocks (a sequence wrote or read them)."""
        now = self._clock_ns()
        for b in block_ids:
            self._touched_ns[b] = now

    # --- prefix-cache map -----------------------------------------------------------------

    def cache_block(self, block_id: int, key: CacheKey) -> bool:
        """Give an in-use, full block its content key; False if another block holds that key.

        The first block to register a key keeps it: a duplicate (two sequences that computed
        the same prefix at once) stays uncached and returns to the free list when released.
        """
        if self._ref_counts[block_id] == 0:
            raise UseAfterFree(f"block {block_id} is not in use; only an owner may cache it")
        if self._keys[block_id] is not None or key in self._cached:
            return False
        self._keys[block_id] = key
        self._cached[key] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop a block's content key (its K/V was never written); a no-op without one."""
        key = self._keys[block_id]
        if key is None:
            return
        if self._ref_counts[block_id] == 0:
            raise UseAfterFree(f"block {block_id} is not in use; only an owner may uncache it")
        del self._cached[key]
        self._keys[block_id] = None

    def lookup(self, key: CacheKey) -> int | None:
        """The block caching `key`, in use or evictable; None on a miss."""
        return self._cached.get(key)

    def is_cached(self, key: CacheKey) -> bool:
        """Whether some block (in use or evictable) holds `key`."""
        return key in self._cached

    # --- read-only views (audit, stats, tests) ---------------------------------------------

    def ref_count(self, block_id: int) -> int:
        """Owners of `block_id` (0 = free or evictable)."""
        return self._ref_counts[block_id]

    def key_of(self, block_id: int) -> CacheKey | None:
        """The block's cache key, or None when it holds no reusable content."""
        return self._keys[block_id]

    def touched_ns(self, block_id: int) -> int:
        """Clock time (ns) of the block's last allocation, hit or write."""
        return self._touched_ns[block_id]

    def now_ns(self) -> int:
        """The pool's clock (injectable for tests)."""
        return self._clock_ns()

    def free_block_ids(self) -> list[int]:
        """Free blocks in reuse order (the next allocation takes the first)."""
        return self._free[::-1]

    def evictable_block_ids(self) -> list[int]:
        """Evictable blocks in eviction order (least recently used first)."""
        return list(self._evictable)

    def ref_counts(self) -> list[int]:
        """A copy of every block's ref count, indexed by block id."""
        return list(self._ref_counts)

    def cached_items(self) -> list[tuple[CacheKey, int]]:
        """Every (key, block id) pair of the prefix-cache map."""
        return list(self._cached.items())
