"""The cost model and the scheduler's fetch decision, with rates set by hand (exact, no timing)."""

from __future__ import annotations

import os
import random

import pytest

from ctxwarden.kv import KVCacheManager
from ctxwarden.kv.tiers import CostModel, KVTiers, PageFormat, SpilledPage, TierNamespace
from ctxwarden.kv.tiers.config import TierSpec, TiersConfig
from ctxwarden.plan.kv import KVGroup, KVLayout
from ctxwarden.request import Request
from ctxwarden.sampling import SamplingParams
from ctxwarden.scheduler.tiering import fetch_prefix

BS = 4
PAGE = PageFormat("fp32", (1, 2, BS, 1, 8), 256)
NS = TierNamespace("w", "t", "fp32", "fp32", "layout", BS, "rope")


def test_decide_weighs_round_trips_bytes_and_the_prefill_rate():
    cost = CostModel(prefill_tokens_per_s=1000.0)
    assert cost.recompute_s(500) == pytest.approx(0.5)
    for _ in range(60):  # measured: 1 ms a round trip, 100 MB/s
        cost.observe_latency("redis", 1e-3)
        cost.observe_fetch("redis", 10_000_000, 1e-3 + 0.1, 1)
    assert cost.latency_s("redis") == pytest.approx(1e-3, rel=1e-3)
    assert cost.bytes_per_s("redis") == pytest.approx(1e8, rel=1e-3)
    d = cost.decide("redis", num_tokens=500, num_bytes=10_000_000, num_round_trips=2)
    assert d.is_fetch and d.fetch_s == pytest.approx(0.102, rel=1e-3) and d.recompute_s == pytest.approx(0.5)
    assert cost.decide("redis", 50, 10_000_000, 2).action == "skipped"  # 0.05 s to recompute: cheaper
    cost.observe_prefill(1000, 0.5)  # a real prefill ran at 2000 tokens/s: the rate moves towards it
    assert cost.prefill_tokens_per_s == pytest.approx(1000 + 0.3 * 1000)


def test_bad_news_is_believed_at_once_and_a_stale_skip_is_probed():
    now = [0.0]
    cost = CostModel(prefill_tokens_per_s=1000.0, reprobe_s=30.0, clock=lambda: now[0])
    cost.observe_fetch("redis", 10_000_000, 0.1, 0)  # 100 MB/s
    assert cost.decide("redis", 500, 10_000_000, 0).is_fetch  # 0.1 s < 0.5 s
    cost.observe_fetch("redis", 1_000_000, 0.1, 0)  # one fetch at 10 MB/s: believed at once
    assert cost.bytes_per_s("redis") == pytest.approx(1e7)
    d = cost.decide("redis", 500, 10_000_000, 0)  # now 1 s > 0.5 s
    assert d.action == "skipped"
    now[0] = 31.0  # skipped for 31 s: nobody measured the link since
    probe = cost.decide("redis", 500, 10_000_000, 0)
    assert probe.is_fetch and probe.is_probe
    cost.observe_fetch("redis", 10_000_000, 0.1, 0)  # the link is fast again: good news, gradually
    assert 1e7 < cost.bytes_per_s("redis") < 1e8


class _Setup:
    """A RAM tier holding a 24-block prompt, a manager whose pool holds none of it."""

    def __init__(self, prefill_tokens_per_s: float):
        layout = KVLayout((KVGroup("full", (0,), None),), BS, PAGE.page_bytes // BS)
        self.kv = KVCacheManager(layout, 64)
        self.tiers = KVTiers(TiersConfig((TierSpec("ram", capacity_bytes=1 << 20),)), NS, PAGE, BS,
                             CostModel(prefill_tokens_per_s))
        rng = random.Random(0)
        self.req = Request("r", [rng.randrange(1, 1000) for _ in range(24 * BS + 1)], SamplingParams())
        self.keys = (NS.digest,)
        root, chain = self.kv.root("", self.keys), self.kv.block_hashes(self.req.prompt_token_ids, "", self.keys)
        self.pages = [os.urandom(PAGE.page_bytes) for _ in chain]
        self.tiers.spill([SpilledPage(root, j, h, chain[j - 1] if j else root,
                                      tuple(self.req.prompt_token_ids[j * BS:(j + 1) * BS]), self.pages[j])
                          for j, h in enumerate(chain)])

    def fetch(self, policy="auto", max_blocks=24):
        return fetch_prefix(self.tiers, self.kv, self.req, 0, self.keys, max_blocks, policy)

    def stats(self):
        return self.tiers.stats()[0]


def test_a_slow_prefill_fetches_a_fast_one_skips_the_tier():
    slow = _Setup(prefill_tokens_per_s=10.0)  # 96 tokens cost 9.6 s to recompute
    got = slow.fetch()
    assert got.num_blocks == 24 and [bytes(p) for p in got.pages] == slow.pages
    assert slow.stats().decision("fetch") == 1
    fast = _Setup(prefill_tokens_per_s=1e9)  # recompute costs ~0.1 us: not worth even a lookup
    assert fast.fetch() is None
    assert fast.stats().decision("skipped") == 1 and fast.stats().num_lookups == 0
    assert fast.fetch("always").num_blocks == 24  # unless told to fetch whatever is there


def test_the_tier_is_skipped_when_its_measured_cost_passes_recompute():
    s = _Setup(prefill_tokens_per_s=1e5)  # 96 tokens: 0.96 ms to recompute
    for _ in range(30):  # this "RAM" has become slow: 10 ms for 6 KB
        s.tiers.cost.observe_fetch("ram", 6144, 0.01, 1)
    assert s.fetch() is None
    assert s.stats().decision("skipped") == 1 and s.stats().num_lookups == 1 and s.stats().num_hit_blocks == 0


def test_a_fetch_past_its_deadline_is_abandoned_and_the_rest_recomputed(redis_server):
    """The link stalls mid-fetch (SIGSTOP for 0.3 s, under the 1 s socket timeout): the batch
    in flight arrives late, the deadline has passed, the rest is left to recompute."""
    import threading
    import time

    from ctxwarden.kv.tiers import Expected, StoreJob

    spec = TierSpec("redis", url=redis_server.url, object_bytes=PAGE.page_bytes, batch_objects=10, timeout_ms=1000)
    tiers = KVTiers(TiersConfig((spec,)), NS, PAGE, BS)
    kv = KVCacheManager(KVLayout((KVGroup("full", (0,), None),), BS, PAGE.page_bytes // BS), 256)
    try:
        rng = random.Random(1)
        tokens = [rng.randrange(1, 1000) for _ in range(100 * BS + 1)]
        root, chain = kv.root("", (NS.digest,)), kv.block_hashes(tokens, "", (NS.digest,))
        pages = [os.urandom(PAGE.page_bytes) for _ in chain]
        tiers._write(tiers.tier("redis"), StoreJob(root, tuple(chain), tuple(tokens[:100 * BS]), 0, tuple(pages)))
        exp = Expected(root, chain, tokens, BS, PAGE)
        (run,) = tiers.lookup(exp, 0, 100)
        assert run.num_blocks == 100
        late = tiers.fetch(run, exp, deadline_s=time.monotonic() - 1)  # already past: nothing is asked
        assert late.num_blocks == 0 and late.shortfall == "deadline"
        redis_server.stop()
        threading.Timer(0.3, redis_server.cont).start()
        stalled = tiers.fetch(run, exp, deadline_s=time.monotonic() + 0.05)
        assert stalled.shortfall == "deadline" and stalled.num_blocks == 10  # the one batch in flight
        assert [bytes(p) for p in stalled.pages] == pages[:10]
        # projected: 10 of 100 blocks took 0.3 s, the other 90 would end past a 2 s deadline
        redis_server.stop()
        threading.Timer(0.3, redis_server.cont).start()
        began = time.monotonic()
        projected = tiers.fetch(run, exp, deadline_s=began + 2.0)
        assert projected.shortfall == "deadline" and projected.num_blocks == 10
        assert time.monotonic() - began < 1.5  # gave up after the first batch, not at 2 s
        assert tiers.stats()[0].decision("recompute") == 3
        assert tiers.cost.bytes_per_s("redis") < 1e6  # and the next decision knows the link is slow
    finally:
        tiers.close()
