"""KVCacheManager on hand-written scenarios: exact block ids, hits, eviction order, errors."""

import pytest
from kv_layouts import slots, uniform_layout

import ctxwarden.kv.manager as manager_module
from ctxwarden.errors import (DoubleFree, KVPoolExhausted, SequenceExists, UnknownSequence,
                              UseAfterFree)
from ctxwarden.kv import KVCacheManager, root_hash


def make(num_blocks=10, block_size=4, **kw) -> KVCacheManager:
    return KVCacheManager(uniform_layout(block_size), num_blocks, **kw)


def test_allocate_append_free_exact_ids():
    m = make()
    alloc = m.allocate("a", list(range(10)))
    assert (alloc.num_computed_tokens, alloc.num_new_tokens, alloc.num_new_blocks) == (0, 10, 3)
    assert m.block_tables("a") == ([0, 1, 2],)
    m.append("a", [10, 11])  # fills block 2, no new block
    m.append("a", [12])  # opens block 3
    assert m.block_tables("a") == ([0, 1, 2, 3],) and m.num_tokens("a") == 13
    m.free("a")
    # full blocks 0..2 keep their content (tail first); partial block 3 is plain free
    assert m.pool.evictable_block_ids() == [2, 1, 0]
    assert m.pool.free_block_ids()[:2] == [3, 4]


def test_prefix_hit_shares_blocks_and_is_capped_at_prompt_minus_one():
    m = make()
    m.allocate("a", list(range(8)))  # two full blocks, both cached
    b = m.allocate("b", list(range(8)))  # identical prompt: last token must be computed
    assert b.num_computed_tokens == 4 and b.num_hit_blocks == 1
    assert m.block_tables("b") == ([0, 2],)  # block 2 repeats 1's tokens: stays uncached
    c = m.allocate("c", list(range(9)))
    assert c.num_computed_tokens == 8 and m.block_tables("c") == ([0, 1, 3],)
    assert m.pool.ref_count(0) == 3 and m.pool.ref_count(1) == 2
    s = m.stats()
    assert (s.num_prefix_queries, s.num_prefix_query_tokens, s.num_prefix_hit_tokens) == (3, 25, 12)


def test_blocks_filled_by_append_become_hits():
    m = make()
    m.allocate("a", [7, 7, 7])
    m.append("a", [8])  # block 0 now full -> cached
    m.append("a", [9, 9, 9, 9])
    assert m.allocate("b", [7, 7, 7, 8, 9, 9, 9, 9, 1]).num_computed_tokens == 8
    assert m.block_tables("b")[0][:2] == m.block_tables("a")[0][:2]


def test_preempted_sequence_recomputes_from_the_cache():
    m = make()
    prompt = list(range(13))
    m.allocate("a", prompt)
    m.append("a", [100, 101, 102])  # 16 tokens: 4 full blocks
    tokens = prompt + [100, 101, 102]
    m.free("a")  # preemption by recompute
    again = m.allocate("a", tokens)
    assert again.num_computed_tokens == 12  # capped at 16 - 1 -> 3 blocks
    # the last block holds the last token, which is always computed: a fresh block (4), and
    # the evicted-by-nobody cached copy in block 3 keeps its key
    assert m.block_tables("a") == ([0, 1, 2, 4],)
    assert m.pool.evictable_block_ids() == [3]


def test_shared_tokens_bound_what_is_looked_up_and_cached():
    """With shared_tokens (the engine passes the prompt's length when generated tokens'
    KV differs from a prompt's), blocks past it are neither registered nor hit."""
    m = make()
    prompt = list(range(6))  # block 0 full, block 1 half prompt
    m.allocate("a", prompt, shared_tokens=6)
    m.append("a", [100, 101, 102, 103, 104, 105])  # blocks 1 (mixed) and 2 (generated) fill
    assert [b for _, b in m.pool.cached_items()] == m.block_tables("a")[0][:1]  # block 0 alone
    tokens = prompt + [100, 101, 102, 103, 104, 105]
    m.free("a")  # preemption by recompute: the generated tokens are recomputed
    again = m.allocate("a", tokens, shared_tokens=6)
    assert again.num_computed_tokens == 4
    # another prompt holding those tokens as its prompt computes its own blocks, and
    # caches them: they are prompt KV
    b = m.allocate("b", tokens + [7])
    assert b.num_computed_tokens == 4
    assert m.allocate("c", tokens + [7, 8]).num_computed_tokens == 12
    # the recomputed sequence still never hits them (they were made as prompt tokens)
    m.free("a")
    assert m.allocate("a", tokens, shared_tokens=6).num_computed_tokens == 4


def test_eviction_under_pressure_takes_tails_of_the_chain_first():
    m = make(num_blocks=6)
    m.allocate("a", list(range(12)))  # blocks 0, 1, 2 cached
    m.free("a")
    m.allocate("x", [50] * 12)  # takes free 3, 4, 5, then must evict the LRU tail (2)
    assert m.block_tables("x") == ([3, 4, 5],)
    m.append("x", [50])
    assert m.block_tables("x") == ([3, 4, 5, 2],)
    assert m.stats().num_evictions == 1
    assert m.find_prefix(list(range(12)) + [0]).num_computed_tokens == 8  # heads survive


def test_a_hit_on_evictable_blocks_counts_them_in_the_check():
    m = make(num_blocks=3)
    m.allocate("a", list(range(8)))
    m.free("a")  # 0, 1 evictable; 2 free
    assert m.can_allocate(list(range(8)) + [9])  # revives 0, 1 and takes 2
    assert not m.can_allocate(list(range(8)) + list(range(9, 14)))  # would need 2 new blocks
    alloc = m.allocate("b", list(range(9)))
    assert (alloc.num_computed_tokens, alloc.num_new_blocks) == (8, 1)
    assert m.block_tables("b") == ([0, 1, 2],) and m.stats().num_evictions == 0


def test_exhaustion_is_a_named_error_and_changes_nothing():
    m = make(num_blocks=4)
    m.allocate("a", list(range(12)))
    assert not m.can_allocate(list(range(100, 108)))
    with pytest.raises(KVPoolExhausted):
        m.allocate("b", list(range(100, 108)))
    assert not m.can_append("a", 5)
    with pytest.raises(KVPoolExhausted):
        m.append("a", [1, 2, 3, 4, 5])
    assert m.num_tokens("a") == 12 and m.audit(["a"]).is_clean
    assert m.stats().num_prefix_queries == 1  # the refused call is not a query


def test_chunked_prefill_slots_the_prompt_in_steps():
    m = make(num_blocks=10)
    prompt = list(range(14))
    alloc = m.allocate("a", prompt, max_num_new_tokens=5)
    assert (alloc.num_new_tokens, m.num_tokens("a"), m.block_tables("a")) == (5, 5, ([0, 1],))
    m.append("a", num_new_tokens=6)
    m.append("a")  # the rest of the prompt
    assert m.num_tokens("a") == 14 and m.block_tables("a") == ([0, 1, 2, 3],)
    with pytest.raises(ValueError, match=r"num_new_tokens must be in \[0, 0\]"):
        m.append("a", num_new_tokens=1)


def test_sequence_lifecycle_errors():
    m = make()
    m.allocate("a", [1, 2])
    with pytest.raises(SequenceExists):
        m.allocate("a", [1, 2])
    m.free("a")
    with pytest.raises(DoubleFree):
        m.free("a")
    with pytest.raises(UseAfterFree):
        m.append("a", [3])
    with pytest.raises(UseAfterFree):
        m.block_tables("a")
    with pytest.raises(UnknownSequence):
        m.free("never")
    with pytest.raises(ValueError, match="at least 1 prompt token"):
        m.allocate("e", [])


def test_slots_from_block_tables():
    m = make()
    m.allocate("other", [9])  # block 0
    m.allocate("a", list(range(6)))  # blocks 1, 2
    assert slots(m, "a", 0, 6) == [4, 5, 6, 7, 8, 9]
    with pytest.raises(LookupError):
        slots(m, "a", 5, 7)  # position 6 has no slot yet


def test_namespaces_never_share_blocks():
    m = make(num_blocks=20)
    prompt = list(range(12))
    m.allocate("a", prompt, namespace="tenant-a")
    b = m.allocate("b", prompt, namespace="tenant-b")
    assert b.num_computed_tokens == 0
    assert not set(m.block_tables("a")[0]) & set(m.block_tables("b")[0])
    m.free("a")
    assert m.allocate("b2", prompt, namespace="tenant-b").num_computed_tokens == 8
    assert m.allocate("a2", prompt, namespace="tenant-a").num_computed_tokens == 8
    assert m.stats().num_cross_namespace_hits == 0


def test_a_forced_cross_namespace_collision_is_counted_and_refused(monkeypatch):
    # A salt that ignores the namespace makes two tenants' hashes equal: the manager's
    # per-block namespace check must refuse the hit and count it.
    monkeypatch.setattr(manager_module, "root_hash", lambda ns, extra=(): root_hash("same"))
    m = make(num_blocks=20)
    m.allocate("a", list(range(12)), namespace="tenant-a")
    b = m.allocate("b", list(range(12)), namespace="tenant-b")
    assert b.num_computed_tokens == 0 and m.stats().num_cross_namespace_hits == 1
    assert not set(m.block_tables("a")[0]) & set(m.block_tables("b")[0])


def test_extra_keys_separate_the_cache():
    m = make(num_blocks=20)
    m.allocate("a", list(range(9)), extra_keys=("lora-1",))
    assert m.allocate("b", list(range(9)), extra_keys=("lora-2",)).num_computed_tokens == 0
    assert m.allocate("c", list(range(9)), extra_keys=("lora-1",)).num_computed_tokens == 8


def test_prefix_caching_off_never_hits_and_frees_to_the_free_list():
    m = make(enable_prefix_caching=False)
    m.allocate("a", list(range(8)))
    m.free("a")
    assert m.pool.num_evictable_blocks == 0
    assert m.allocate("b", list(range(9))).num_computed_tokens == 0
    assert m.stats().num_prefix_queries == 0


def test_free_after_a_failed_step_drops_keys_of_unwritten_blocks():
    m = make()
    m.allocate("a", list(range(8)))
    m.append("a", list(range(8, 12)))  # the step writing tokens 8..11 fails
    m.free("a", num_computed_tokens=8)
    assert m.pool.evictable_block_ids() == [1, 0]  # block 2 (unwritten) lost its key
    assert m.find_prefix(list(range(13))).num_computed_tokens == 8
    assert m.audit([]).is_clean
