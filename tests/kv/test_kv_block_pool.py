"""BlockPool: exact block ids, reuse order, LRU eviction order, named errors."""

import pytest

from ctxwarden.errors import DoubleFree, KVPoolExhausted, UseAfterFree
from ctxwarden.kv import BlockPool


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(6, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_in_use_blocks, pool.num_free_blocks, pool.num_evictable_blocks) == (5, 1, 0)


def test_freed_blocks_without_content_are_reused_first_tail_first_order():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)  # [0, 1, 2]
    pool.allocate(1)  # [3]
    pool.free(reversed(a))  # tail first: 2, 1, 0 pushed; 0 is on top
    assert pool.free_block_ids() == [0, 1, 2, 4, 5]
    assert pool.allocate(2) == [0, 1]


def test_cached_blocks_are_kept_until_free_ones_run_out_then_evicted_lru():
    pool = BlockPool(5, 4)
    a = pool.allocate(2)  # [0, 1] -> cached
    b = pool.allocate(2)  # [2, 3] -> cached
    for i, blk in enumerate(a + b):
        assert pool.cache_block(blk, ("k", i))
    pool.free([1, 0])  # released first: evicted first, tail (1) before head (0)
    pool.free([3, 2])
    assert pool.evictable_block_ids() == [1, 0, 3, 2]
    assert pool.allocate(1) == [4]  # the free block goes before any cached one
    assert pool.num_evictions == 0
    assert pool.allocate(3) == [1, 0, 3]
    assert pool.num_evictions == 3
    assert pool.lookup(("k", 1)) is None and pool.lookup(("k", 3)) is None
    assert pool.lookup(("k", 2)) == 2  # the most recently released survives
    assert pool.key_of(1) is None


def test_touch_revives_an_evictable_block_and_moves_it_off_the_lru():
    pool = BlockPool(3, 4)
    ids = pool.allocate(3)
    for blk in ids:
        pool.cache_block(blk, blk)
    pool.free([2, 1, 0])
    pool.touch([1])
    assert pool.ref_count(1) == 1 and pool.evictable_block_ids() == [2, 0]
    pool.touch([1])  # a second owner shares it
    assert pool.ref_count(1) == 2 and pool.num_in_use_blocks == 1
    pool.free([1])
    pool.free([1])
    assert pool.evictable_block_ids() == [2, 0, 1]  # most recently used last


def test_exhaustion_raises_named_error_and_changes_nothing():
    pool = BlockPool(3, 4)
    pool.allocate(2)
    with pytest.raises(KVPoolExhausted) as err:
        pool.allocate(2)
    assert (err.value.num_blocks_needed, err.value.num_blocks_available) == (2, 1)
    assert "needs 2 blocks but only 1 of 3" in str(err.value)
    assert pool.num_free_blocks == 1 and pool.num_in_use_blocks == 2


def test_double_free_and_use_after_free_raise():
    pool = BlockPool(3, 4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(DoubleFree):
        pool.free([b])
    with pytest.raises(UseAfterFree):
        pool.touch([b])  # free and uncached: nothing to share
    with pytest.raises(UseAfterFree):
        pool.cache_block(b, "key")


def test_a_key_is_held_by_one_block_only():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, "same")
    assert not pool.cache_block(b, "same")  # duplicate content stays uncached
    pool.free([b, a])
    assert pool.free_block_ids()[0] == b and pool.evictable_block_ids() == [a]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockPool(4, 0)
