"""The scheduler on a real block manager, no model: admission, FCFS, chunking, the hang guard."""

from __future__ import annotations

import pytest

from ctxwarden.config import load_model_config
from ctxwarden.errors import ContextLengthExceeded, KVCapacityExceeded, QueueFull
from ctxwarden.kv import KVCacheManager
from ctxwarden.plan import kv_layout
from ctxwarden.request import FinishReason, Request, RequestStatus
from ctxwarden.sampling import SamplingParams
from ctxwarden.scheduler import PreemptionCost, Scheduler, SchedulerConfig
from pathlib import Path

SPEC = load_model_config(Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "smollm2-135m-instruct.json")


def _scheduler(num_blocks=8, **config):
    kv = KVCacheManager(kv_layout(SPEC, "fp32", 16), num_blocks)
    return Scheduler(kv, SchedulerConfig(window_tokens=8192, **config), PreemptionCost(2.7e8, 46_080))


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
