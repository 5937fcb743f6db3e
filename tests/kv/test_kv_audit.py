"""The audit: clean when the books balance, a named finding for each kind of breach."""

import pytest
from kv_layouts import uniform_layout

from ctxwarden.kv import KVCacheManager, RiskThresholds
from ctxwarden.kv import audit as A


def make(clock, num_blocks=10, **kw):
    return KVCacheManager(uniform_layout(4), num_blocks, clock_ns=clock, **kw)


def test_clean_pool_reports_owners_with_ages(clock):
    m = make(clock)
    m.allocate("a", list(range(9)))
    clock.advance_ms(30)
    m.allocate("b", list(range(9)))  # shares a's two full blocks
    clock.advance_ms(20)
    report = m.audit(["a", "b"])
    assert report.is_clean and report.identity_holds
    assert (report.num_blocks_in_use, report.num_blocks_free) == (4, 6)
    owners = {o.seq_id: o for o in report.owners}
    assert owners["a"].block_ids == (0, 1, 2) and owners["b"].block_ids == (0, 1, 3)
    assert owners["a"].age_ms == 50 and owners["b"].age_ms == 20
    assert owners["a"].risk == A.RISK_LIVE


def test_leaks_are_ranked_by_time_since_the_owner_finished(clock):
    m = make(clock, risk_thresholds=RiskThresholds(low_below_ms=100, high_above_ms=5000))
    for s in ("a", "b", "c", "d"):
        m.allocate(s, [1])
    finished = {"a": clock.now_ns}
    clock.advance_ms(50)
    finished["b"] = clock.now_ns - int(1e9)  # finished 1 s before now
    clock.advance_ms(6000)
    report = m.audit(live_seq_ids=["d"], finished_at_ns=finished)
    risks = {o.seq_id: o.risk for o in report.owners}
    assert risks == {"a": "high", "b": "high", "c": "high", "d": "live"}
    report = m.audit(live_seq_ids=["d"], finished_at_ns={"a": clock.now_ns - int(50e6),
                                                         "b": clock.now_ns - int(2e9)})
    risks = {o.seq_id: o.risk for o in report.owners}
    assert (risks["a"], risks["b"], risks["c"]) == ("low", "medium", "high")
    assert [f.seq_id for f in report.findings_of(A.LEAK)] == ["a", "b", "c"]
    m.free("a"), m.free("b"), m.free("c")
    assert m.audit(["d"]).is_clean


def test_risk_thresholds_are_validated():
    with pytest.raises(ValueError, match="low_below_ms <= high_above_ms"):
        RiskThresholds(low_below_ms=10, high_above_ms=1)


# The audit must catch corruption the manager's own counters would hide: these tests break
# the pool's private state on purpose, then ask the audit to find it.

def test_audit_finds_a_ref_count_that_disagrees_with_the_tables(clock):
    m = make(clock)
    m.allocate("a", list(range(5)))
    m.pool._ref_counts[1] += 1
    assert [(f.kind, f.block_id) for f in m.audit(["a"]).findings] == [(A.REF_COUNT_MISMATCH, 1)]


def test_audit_finds_an_orphan_block_and_a_broken_identity(clock):
    m = make(clock)
    m.allocate("a", [1, 2])
    m.pool._free.remove(5)  # a block lost from every list
    report = m.audit(["a"])
    assert not report.identity_holds
    assert {f.kind for f in report.findings} == {A.IDENTITY}
    m.pool._ref_counts[5] = 1  # now it is "in use" with no owner
    assert {f.kind for f in m.audit(["a"]).findings} == {A.ORPHAN}


def test_audit_finds_blocks_owned_twice(clock):
    m = make(clock)
    m.allocate("a", list(range(5)))  # block 0 full and cached, block 1 partial
    m.allocate("b", [7])  # block 2
    b_table = m._seqs["b"].tables[0].block_ids
    b_table.append(1)  # b claims a's partial, uncached block (ref count kept consistent)
    m.pool._ref_counts[1] += 1
    assert [(f.kind, f.block_id) for f in m.audit(["a", "b"]).findings] == [
        (A.SHARED_UNCACHED, 1)]
    b_table.append(2)  # b names its own block twice
    m.pool._ref_counts[2] += 1
    assert [(f.kind, f.block_id, f.seq_id) for f in m.audit(["a", "b"]).findings] == [
        (A.OWNED_TWICE, 2, "b"), (A.SHARED_UNCACHED, 1, None), (A.SHARED_UNCACHED, 2, None)]


def test_audit_finds_a_free_block_still_in_use(clock):
    m = make(clock)
    m.allocate("a", [1])
    m.pool._free.append(0)
    kinds = {f.kind for f in m.audit(["a"]).findings}
    assert A.BAD_FREE_LIST in kinds and A.IDENTITY in kinds


def test_stats_carry_the_audit_findings(clock):
    m = make(clock)
    m.allocate("a", [1])
    assert m.stats().audit_findings == ()
    m.pool._ref_counts[0] = 2
    assert [f.kind for f in m.stats().audit_findings] == [A.REF_COUNT_MISMATCH]
