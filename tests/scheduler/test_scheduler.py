"""The scheduler on a real block manager, no model: admission, FCFS, chunking, the hang guard."""

from __future__ import annotations

import random

import pytest

from ctxwarden.spec.model_spec import load_model_config
from ctxwarden.errors import (ContextLengthExceeded, KVCapacityExceeded, QueueDelayExceeded, QueueFull,
                              TenantLimitExceeded)
from ctxwarden.kv import BlockTables, KVCacheManager
from ctxwarden.plan import kv_layout
from ctxwarden.request import FinishReason, Request, RequestStatus, TenantShare
from ctxwarden.sampling import SamplingParams
from ctxwarden.scheduler import PreemptionCost, Scheduler, SchedulerConfig
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
SPEC = load_model_config(CONFIGS / "smollm2-135m-instruct.json")


def _scheduler(num_blocks=8, **config):
    kv = KVCacheManager(kv_layout(SPEC, "fp32", 16), num_blocks)
    return Scheduler(kv, SchedulerConfig(max_model_len=8192, **config), PreemptionCost(2.7e8, 46_080))


def _req(rid, n_prompt, max_tokens=4, arrival=0.0):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens), arrival_s=arrival)


def test_refusals_name_the_numbers_and_queue_nothing():
    s = _scheduler(num_blocks=8)
    with pytest.raises(ContextLengthExceeded, match="8192"):
        s.add(_req("a", 8000, max_tokens=500))
    with pytest.raises(KVCapacityExceeded, match="8 blocks|holds 8"):
        s.add(_req("b", 120, max_tokens=20))  # 140 tokens = 9 blocks of 16 > 8
    assert not s.has_work


def test_bounded_queue_raises_queue_full():
    s = _scheduler(max_waiting=1)
    s.add(_req("a", 10))
    with pytest.raises(QueueFull, match="1 of 1"):
        s.add(_req("b", 10))


def test_chunked_prefill_and_fcfs_under_a_token_budget():
    s = _scheduler(num_blocks=32, max_batched_tokens=40)
    for i, n in enumerate((70, 30)):
        s.add(_req(f"r{i}", n, arrival=float(i)))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.is_sampled) for x in out.scheduled] == [("r0", 40, False)]
    for x in out.scheduled:
        s.after_step(x)
    out = s.schedule()  # r0's last 30 prompt tokens, then r1 gets the remaining 10 of the budget
    assert [(x.request.request_id, x.num_new_tokens, x.is_sampled) for x in out.scheduled] == [
        ("r0", 30, True), ("r1", 10, False)]


def test_a_request_that_cannot_enter_an_empty_pool_is_ended_not_waited_on():
    """The hang guard: if admission arithmetic ever let through a request the pool cannot
    hold, the scheduler ends it with an error instead of waiting forever."""
    s = _scheduler(num_blocks=4)
    bad = _req("bad", 100)  # 7 blocks: bypass add()'s check to simulate an admission bug
    s.waiting.append(bad)
    out = s.schedule()
    assert out.refused == (bad,) and not out.scheduled
    assert bad.status is RequestStatus.FINISHED and bad.finish_reason is FinishReason.ERROR
    assert not s.has_work and s.kv.audit(live_seq_ids=()).is_clean


# --- preemption, exact state ------------------------------------------------------------------
# Two 32-token prompts fill a pool of 4 blocks of 16 (2 each). After their first sampled token,
# each needs a third block: the pool has none, so the worst running request (the later
# arrival, b) is preempted and a takes the block b's release made evictable.

def _two_full(mode="recompute", same_prompt=False, **config):
    s = _scheduler(num_blocks=4, preemption_mode=mode, **config)
    a = _req("a", 32, max_tokens=8, arrival=0.0)
    b = _req("b", 32, max_tokens=8, arrival=1.0)
    if not same_prompt:
        b.prompt_token_ids = list(range(100, 132))
    s.add(a)
    s.add(b)
    _step(s, tokens={"a": 5, "b": 6})
    return s, a, b


def _step(s, tokens=None):
    """One schedule + a finished forward; then each request named in `tokens` samples one."""
    out = s.schedule()
    for x in out.scheduled:
        s.after_step(x)
    for r in [x.request for x in out.scheduled if x.is_sampled]:
        r.output_token_ids.append((tokens or {}).get(r.request_id, 7))
    return out


def _tables(out):
    return {x.request.request_id: x.block_tables.groups for x in out.scheduled}


def test_recompute_preemption_frees_the_later_request_and_keeps_its_blocks_cached():
    s, a, b = _two_full("recompute")
    assert s.kv.block_tables("a") == ([0, 1],) and s.kv.block_tables("b") == ([2, 3],)
    out = _step(s)
    assert [(p.request.request_id, p.mode, p.block_tables.groups) for p in out.preempted] == [
        ("b", "recompute", ((2, 3),))]
    assert _tables(out) == {"a": ((0, 1, 3),)}  # b's tail (block 3) is evicted first
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.kv.pool.evictable_block_ids() == [2]  # b's head stays cached for its recompute
    assert s.stats().num_preemptions_recompute == 1 and s.stats().num_waiting == 1
    out = _step(s)  # b's recompute needs 2 new blocks + its cached one: it waits (FCFS)
    assert _tables(out) == {"a": ((0, 1, 3),)} and not out.preempted
    s.finish(a, FinishReason.STOP)
    out = _step(s)
    # hit on page 2; then a's partial page 3 (free, uncached), then a's chain tail (page 1)
    # is evicted before its head (page 0)
    assert _tables(out) == {"b": ((2, 3, 1),)}
    assert b.num_computed_tokens == 33 and out.scheduled[0].num_new_tokens == 17
    assert s.audit().is_clean


def test_auto_mode_swaps_when_copying_is_cheaper_and_host_space_allows():
    s, a, b = _two_full("auto")  # 46 KB/token at 27 GB/s vs 0.27 GFLOP/token at 80 GFLOP/s
    out = _step(s)
    assert [(p.request.request_id, p.mode) for p in out.preempted] == [("b", "swap")]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 32
    assert s.swapped_bytes == 2 * s.kv.layout.page_bytes == s.stats().swapped_bytes
    assert s.stats().num_swapped == 1 and s.stats().num_preemptions_swap == 1


def test_auto_mode_recomputes_when_host_swap_space_is_full():
    s, a, b = _two_full("auto", swap_space_bytes=0)
    out = _step(s)
    assert [(p.request.request_id, p.mode) for p in out.preempted] == [("b", "recompute")]
    assert s.swapped_bytes == 0 and b.num_computed_tokens == 0


def test_auto_mode_recomputes_when_recompute_is_cheaper():
    s = _scheduler(num_blocks=4, preemption_mode="auto")
    s.cost = PreemptionCost(flops_per_token=1.0, kv_bytes_per_token=46_080)  # free to recompute
    a, b = _req("a", 32, 8, 0.0), _req("b", 32, 8, 1.0)
    b.prompt_token_ids = list(range(100, 132))
    s.add(a)
    s.add(b)
    _step(s)
    assert [p.mode for p in _step(s).preempted] == ["recompute"]


def test_swap_in_takes_prefix_cached_blocks_and_only_the_rest_is_restored():
    """b shares a's first block; swapped out, then back in after a finishes: the shared block
    is a prefix-cache hit (num_hit_blocks=1, not rewritten from host), the other is new."""
    s, a, b = _two_full("swap", same_prompt=True)
    assert s.kv.block_tables("b") == ([0, 2],)  # block 0 shared with a
    out = _step(s)
    assert [(p.request.request_id, p.block_tables.groups) for p in out.preempted] == [("b", ((0, 2),))]
    s.finish(a, FinishReason.STOP)
    out = _step(s)
    assert not out.scheduled  # a swap-in only restores pages this step
    (swap_in,) = out.swapped_in
    assert swap_in.request is b and swap_in.num_hit_blocks == 1
    assert swap_in.block_tables.groups == ((0, 3),)  # 0: cached hit; 3: a fresh page to fill
    assert b.status is RequestStatus.RUNNING and s.swapped_bytes == 0
    out = _step(s)
    assert _tables(out) == {"b": ((0, 3, 2),)}  # a free page before evicting a cached one
    assert out.scheduled[0].num_new_tokens == 1


def test_sliding_window_layouts_always_recompute():
    spec = load_model_config(CONFIGS / "mistral-7b-v0.1.json")
    kv = KVCacheManager(kv_layout(spec, "fp32", 16), 8)
    assert any(g.window_tokens is not None for g in kv.layout.groups)
    s = Scheduler(kv, SchedulerConfig(max_model_len=8192, preemption_mode="swap"),
                  PreemptionCost(2.7e8, 46_080))
    tables = BlockTables.of([[0, 1]])
    assert s._preemption_mode(_req("x", 32), tables) == "recompute"


# --- fair sharing between tenants --------------------------------------------------------------

def _tenant_req(rid, ns, n_prompt, arrival, max_tokens=8, **share):
    r = _req(rid, n_prompt, max_tokens=max_tokens, arrival=arrival)
    r.namespace, r.share = ns, TenantShare(ns, **share)
    r.prompt_token_ids = [hash((rid, i)) % 30000 + 100 for i in range(n_prompt)]  # no shared prefix
    return r


def test_a_late_short_request_of_another_tenant_goes_before_the_flood():
    s = _scheduler(num_blocks=400, max_batched_tokens=512)
    flood = [_tenant_req(f"a{i}", "A", 500, arrival=float(i)) for i in range(6)]
    for r in flood:
        s.add(r)
    out = _step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a0", 500), ("a1", 12)]
    b = _tenant_req("b0", "B", 8, arrival=100.0)
    s.add(b)
    out = _step(s)
    # a0 decodes; a1's prefill yields to B (capped at 512 // 16 = 32 before anything is
    # measured); B's whole prompt runs and is sampled; A's queue waits for the next step
    assert [(x.request.request_id, x.num_new_tokens, x.is_sampled) for x in out.scheduled] == [
        ("a0", 1, True), ("a1", 32, False), ("b0", 8, True)]


def test_while_a_less_served_tenant_decodes_a_served_tenants_prefill_is_capped():
    s = _scheduler(num_blocks=400, max_batched_tokens=512, contended_prefill_tokens=32)
    for i in range(3):
        s.add(_tenant_req(f"a{i}", "A", 500, arrival=float(i), max_tokens=100))
    _step(s)
    s.add(_tenant_req("b0", "B", 8, arrival=100.0))
    _step(s)  # b0's prompt runs (and is sampled): from now on b0 decodes
    out = _step(s)
    by_id = {x.request.request_id: x for x in out.scheduled}
    assert by_id["b0"].is_decode and by_id["b0"].num_new_tokens == 1
    prefill = [x for x in out.scheduled if not x.is_decode]
    assert prefill and all(x.num_new_tokens <= 32 for x in prefill)
    assert sum(x.num_new_tokens for x in prefill) <= 32  # one cap for all of A's prefill


def test_a_tenant_alone_keeps_the_whole_budget():
    s = _scheduler(num_blocks=400, max_batched_tokens=512, contended_prefill_tokens=32)
    for i in range(3):
        s.add(_tenant_req(f"a{i}", "A", 500, arrival=float(i), max_tokens=100))
    _step(s)
    out = _step(s)  # a0 decodes, a1 and a2 prefill: one tenant, no cap
    assert out.num_batched_tokens == 512


def test_a_tenant_at_its_running_cap_waits_without_holding_others_up():
    s = _scheduler(num_blocks=400, max_batched_tokens=2048)
    for i in range(3):
        s.add(_tenant_req(f"a{i}", "A", 40, arrival=float(i), max_running=1))
    s.add(_tenant_req("b0", "B", 40, arrival=10.0))
    out = _step(s)
    assert sorted(x.request.request_id for x in out.scheduled) == ["a0", "b0"]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 2


def test_a_tenant_over_its_queue_cap_is_refused_and_the_other_is_not():
    s = _scheduler(num_blocks=400)
    s.add(_tenant_req("a0", "A", 40, arrival=0.0, max_waiting=1))
    with pytest.raises(TenantLimitExceeded, match="'A' is over its limit of 1 queued requests"):
        s.add(_tenant_req("a1", "A", 40, arrival=1.0, max_waiting=1))
    s.add(_tenant_req("b0", "B", 40, arrival=2.0, max_waiting=1))
    assert [r.request_id for r in s.waiting] == ["a0", "b0"]


def test_a_request_predicted_to_wait_too_long_is_refused_with_a_retry_time():
    s = _scheduler(num_blocks=4000, max_queue_delay_s=2.0)
    s.add(_tenant_req("a0", "A", 3000, arrival=0.0, max_tokens=4))  # nothing measured: no refusal
    s.rates.prefill_tokens_per_s = 1000.0
    with pytest.raises(QueueDelayExceeded) as e:
        s.add(_tenant_req("a1", "A", 500, arrival=1.0, max_tokens=4))  # 3,500 tokens of A first
    assert e.value.predicted_s == pytest.approx(3.5) and e.value.retry_after_s == pytest.approx(1.5)
    # another tenant shares fairly: 500 of its own + at most 500 of A's before its first token
    b = _tenant_req("b0", "B", 500, arrival=2.0, max_tokens=4)
    s.add(b)
    assert s.fair.predicted_wait_tokens("B", 1.0, 500, {"A": (3000, 1.0)}) == 1000


def test_step_rates_split_a_mixed_step_between_prefill_and_decodes():
    from ctxwarden.scheduler.fairness import StepRates

    rates, rng = StepRates(), random.Random(0)
    for _ in range(200):
        tokens, decodes = rng.choice((0, 16, 512, 2048)), rng.randint(0, 12)
        rates.observe(tokens, decodes, 0.010 + tokens / 2000 + 0.002 * decodes)
    assert rates.prefill_tokens_per_s == pytest.approx(2000, rel=1e-3)
    assert rates.decode_step_s(5) == pytest.approx(0.010 + 0.002 * 5, rel=1e-3)
    assert abs(rates.prefill_tokens_in(rates.decode_step_s(5)) - 40) <= 1  # the contended cap, 5 decodes
