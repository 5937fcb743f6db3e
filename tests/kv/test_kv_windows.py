"""Sliding windows and sink mode: exact release, pinning, and the planner's bound."""

import pytest
from kv_layouts import hybrid_layout, sink_layout, slots
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxwarden.kv import KVCacheManager
from ctxwarden.plan.kv import KVGroup, KVLayout, blocks_needed, group_blocks_needed


def sliding_only(block_size=4, window_tokens=8) -> KVLayout:
    return KVLayout((KVGroup("sliding", (0,), window_tokens),), block_size, 64)


def test_sliding_window_releases_blocks_wholly_outside_it():
    m = KVCacheManager(sliding_only(), 10)
    m.allocate("a", list(range(10)))
    assert m.block_tables("a") == ([0, 1, 2],)
    m.append("a", [10])  # step from 10 reads back to 3: block 0 still needed
    assert m.block_tables("a") == ([0, 1, 2],)
    m.append("a", [11])  # step from 11 reads back to 4: block 0 (tokens 0-3) goes
    assert m.block_tables("a") == ([None, 1, 2],)
    m.append("a", [12])
    assert m.block_tables("a") == ([None, 1, 2, 3],)
    assert m.pool.evictable_block_ids() == [0]  # full, so its content stays cached
    with pytest.raises(LookupError, match="released"):
        slots(m, "a", 3, 5)
    assert slots(m, "a", 4, 13) == [4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_sink_blocks_stay_pinned_while_the_rest_rolls():
    m = KVCacheManager(sink_layout(block_size=4, window_tokens=8, sink_tokens=4), 10)
    m.allocate("a", list(range(12)))
    for t in range(12, 20):
        m.append("a", [t])
    assert m.block_tables("a") == ([0, None, None, 3, 4],)
    for t in range(20, 40):
        m.append("a", [t])
    table = m.block_tables("a")[0]
    # the step from 39 reads 32..39 (blocks 8, 9) plus the sink block 0
    assert table[0] == 0 and [j for j, b in enumerate(table) if b is not None] == [0, 8, 9]
    assert slots(m, "a", 0, 4) == [0, 1, 2, 3]


def test_prefix_hit_in_a_sliding_group_takes_only_the_window():
    m = KVCacheManager(hybrid_layout(block_size=4, window_tokens=8), 30)
    m.allocate("a", list(range(24)))  # 6 blocks per group: full 0-5, sliding 6-11
    m.free("a")
    hit = m.allocate("b", list(range(25)))
    assert hit.num_computed_tokens == 24 and hit.num_hit_blocks == 6 + 2
    full, sliding = m.block_tables("b")
    assert full == [0, 1, 2, 3, 4, 5, 12]
    # a step from token 24 reads back to 17: blocks 4 and 5 only
    assert sliding == [None, None, None, None, 10, 11, 13]
    assert m.audit(["b"]).is_clean


def test_sliding_hit_needs_the_window_blocks_not_the_head():
    m = KVCacheManager(sliding_only(block_size=4, window_tokens=8), 12)
    m.allocate("a", list(range(8)))
    for t in range(8, 25):
        m.append("a", [t])  # the head rolls out but stays cached
    m.free("a")
    # fill the pool so that the least recently released blocks (the head) get evicted
    m.allocate("filler", [999] * 4 * 8)  # 6 free blocks + the 2 oldest released ones
    assert m.stats().num_evictions == 2
    assert m.find_prefix(list(range(9))).num_computed_tokens == 0  # head gone
    assert m.find_prefix(list(range(25))).num_computed_tokens == 24  # window still cached


LAYOUTS = {"hybrid": hybrid_layout(4, 8), "sink": sink_layout(4, 10, 3),
           "sliding": sliding_only(2, 5)}


@settings(max_examples=60, deadline=None)
@given(layout_name=st.sampled_from(sorted(LAYOUTS)), prompt_tokens=st.integers(1, 30),
       chunks=st.lists(st.integers(1, 9), max_size=12))
def test_held_blocks_never_exceed_the_planner_and_cover_what_the_step_reads(
        layout_name, prompt_tokens, chunks):
    layout = LAYOUTS[layout_name]
    m = KVCacheManager(layout, 200)
    m.allocate("s", list(range(prompt_tokens)))
    n_before, max_chunk = 0, prompt_tokens
    _check_bound(m, layout, max_chunk)
    for c in chunks:
        n_before, max_chunk = m.num_tokens("s"), max(max_chunk, c)
        m.append("s", list(range(n_before, n_before + c)))
        _check_bound(m, layout, max_chunk)
        _check_step_reads(m, layout, n_before)
    assert m.audit(["s"]).is_clean


def _check_bound(m, layout, chunk_tokens):
    n, bs = m.num_tokens("s"), layout.block_size
    tables = m.block_tables("s")
    for group, table in zip(layout.groups, tables):
        held = sum(b is not None for b in table)
        assert held <= group_blocks_needed(n, bs, group.window_tokens, layout.sink_tokens,
                                           chunk_tokens)
    assert sum(b is not None for t in tables for b in t) <= blocks_needed(n, layout, chunk_tokens)


def _check_step_reads(m, layout, n_before):
    """Every position the step from n_before reads (window + sinks) still has a slot."""
    n = m.num_tokens("s")
    for g, group in enumerate(layout.groups):
        start = 0 if group.window_tokens is None else max(0, n_before - group.window_tokens + 1)
        assert len(slots(m, "s", start, n, g)) == n - start
        sinks = min(layout.sink_tokens, n) if group.window_tokens else 0
        assert len(slots(m, "s", 0, sinks, g)) == sinks
