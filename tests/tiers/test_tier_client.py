"""KVTiers over real stores: lookup across tiers, holes, commit records, every corruption, faults."""

from __future__ import annotations

import os
import random
import time

import pytest

from ctxwarden.kv.prefix import extend_chain, root_hash
from ctxwarden.kv.tiers import Expected, KVTiers, PageFormat, SpilledPage, StoreJob, TierNamespace
from ctxwarden.kv.tiers.config import TierSpec, TiersConfig
from ctxwarden.kv.tiers.keys import manifest_key, object_key

BS = 4
PAGE = PageFormat("fp32", (1, 2, BS, 1, 8), 1 * 2 * BS * 8 * 4)  # 256 bytes a page
G_BYTES = 2 * PAGE.page_bytes  # objects of 2 blocks in disk and Redis


def _namespace(weights="w") -> TierNamespace:
    return TierNamespace(weights, "tok", "fp32", "fp32", "layout", BS, "rope")


def _tiers(specs, weights="w") -> KVTiers:
    return KVTiers(TiersConfig(tuple(specs)), _namespace(weights), PAGE, BS)


class Prompt:
    """Token ids, their chain under a tenant, and one random page per full block."""

    def __init__(self, tokens, tenant="t", weights="w", pages=None):
        self.tokens = list(tokens)
        self.root = root_hash(tenant, (_namespace(weights).digest,))
        self.chain = []
        extend_chain(self.chain, self.root, self.tokens, BS, len(self.tokens) // BS)
        self.pages = pages or [os.urandom(PAGE.page_bytes) for _ in self.chain]

    def expected(self) -> Expected:
        return Expected(self.root, self.chain, self.tokens, BS, PAGE)

    def job(self, first=0, end=None) -> StoreJob:
        end = len(self.chain) if end is None else end
        return StoreJob(self.root, tuple(self.chain[:end]), tuple(self.tokens[:end * BS]), first,
                        tuple(self.pages[first:end]))

    def spills(self, blocks) -> list[SpilledPage]:
        return [SpilledPage(self.root, j, self.chain[j], self.chain[j - 1] if j else self.root,
                            tuple(self.tokens[j * BS:(j + 1) * BS]), self.pages[j]) for j in blocks]


def _fetch_all(tiers: KVTiers, p: Prompt, start=0, end=None):
    """(pages fetched from start, per-tier sources) as the scheduler would take them."""
    end = len(p.chain) if end is None else end
    pages, sources, at = [], [], start
    for run in tiers.lookup(p.expected(), start, end):
        if run.first_block != at:
            break
        r = tiers.fetch(run, p.expected(), time.monotonic() + 10)
        pages += [bytes(x) for x in r.pages]
        sources.append((run.tier, r.num_blocks))
        at += r.num_blocks
        if r.shortfall:
            break
    return pages, sources


def _tokens(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_ram_spill_then_disk_then_redis_continue_one_prefix(tmp_path, redis_server):
    tiers = _tiers([TierSpec("ram", capacity_bytes=1 << 20), TierSpec("disk", 1 << 20, str(tmp_path), object_bytes=G_BYTES),
                    TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES)])
    try:
        p = Prompt(_tokens(40))  # 10 blocks
        tiers.spill(p.spills(range(0, 3)))  # RAM: blocks 0-2
        disk, redis = tiers.tier("disk"), tiers.tier("redis")
        tiers._write(disk, p.job(0, 6))  # disk: blocks 0-5 (objects [0,1] [2,3] [4,5])
        tiers._write(redis, p.job(0, 10))  # Redis: everything
        pages, sources = _fetch_all(tiers, p)
        assert pages == p.pages
        # RAM serves 0-2; disk continues at 3 (re-reading object [2,3]), to 5; Redis does 6-9
        assert sources == [("ram", 3), ("disk", 3), ("redis", 4)]
        stats = {s.tier: s for s in tiers.stats()}
        assert stats["disk"].num_hit_blocks == 3 and stats["redis"].num_hit_blocks == 4
        assert stats["redis"].bytes_out == 4 * PAGE.page_bytes
    finally:
        tiers.close()


def test_objects_group_blocks_and_a_partial_tail_is_found(redis_server):
    tiers = _tiers([TierSpec("redis", url=redis_server.url, object_bytes=3 * PAGE.page_bytes)])
    try:
        p = Prompt(_tokens(32))  # 8 blocks: objects [0-2] [3-5] [6-7]
        tiers._write(tiers.tier("redis"), p.job())
        keys = {k.decode() for k in redis_server.client().keys("*")}
        manifests = {k for k in keys if k.startswith(manifest_key(tiers.key_prefix, p.chain[7], b"")[:-1])}
        assert keys - manifests == {object_key(tiers.key_prefix, p.chain[j]) for j in (2, 5, 7)}
        assert len(manifests) == 1
        longer = Prompt(p.tokens + _tokens(12, seed=9), pages=p.pages + [os.urandom(PAGE.page_bytes)] * 3)
        pages, sources = _fetch_all(tiers, longer)
        assert pages == p.pages and sources == [("redis", 8)]  # the stored prefix, then recompute
        shorter = Prompt(p.tokens[:20], pages=p.pages[:5])  # shares blocks 0-4: only whole objects
        assert _fetch_all(tiers, shorter)[0] == p.pages[:3]
    finally:
        tiers.close()


def test_a_hole_in_the_chain_serves_the_prefix_up_to_the_hole(tmp_path, redis_server):
    for spec in (TierSpec("disk", 1 << 20, str(tmp_path), object_bytes=G_BYTES),
                 TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES)):
        tiers = _tiers([spec])
        try:
            p = Prompt(_tokens(40, seed=1))  # objects [0,1] [2,3] [4,5] [6,7] [8,9]
            tiers._write(tiers.tier(spec.kind), p.job())
            tiers.tier(spec.kind).store.delete([object_key(tiers.key_prefix, p.chain[5])])  # evict [4,5]
            pages, _ = _fetch_all(tiers, p)
            assert pages == p.pages[:4]
        finally:
            tiers.close()


def _put(store, key, value):
    store.delete([key])
    store.put_many([(key, value)])


def _flip(store, key):
    v = bytearray(store.get_many([key])[0])
    v[-7] ^= 0x01  # one bit of the last page
    _put(store, key, bytes(v))


def _swap(store, key_a, key_b):
    a, b = store.get_many([key_a, key_b])
    _put(store, key_a, b)
    _put(store, key_b, a)


def _wrong_tokens_value(tiers, p: Prompt, first: int, n: int, manifest_key_hash: bytes) -> bytes:
    """A writer bug: blocks [first, first + n) under their right key with other token ids."""
    from ctxwarden.kv.tiers.value import ObjectHeader, block_sum, encode_object, merkle_root

    sums = tuple(block_sum(x) for x in p.pages[first:first + n])
    parent = p.chain[first - 1] if first else p.root
    h = ObjectHeader(p.root, p.chain[first + n - 1], parent, merkle_root(sums), manifest_key_hash, first, n, sums)
    return encode_object(h, BS, PAGE, [1] * (n * BS), p.pages[first:first + n])


def _other_model_value(t, other: Prompt, last_block: int) -> bytes:
    """Another model's value for the same tokens (written by a tier client of that model)."""
    other_tiers = _tiers([t.spec], weights="other")
    try:
        if t.name == "ram":
            return other_tiers._ram_object(other.spills([last_block])[0])
        other_tiers._write(other_tiers.tier(t.name), other.job())
        return other_tiers.tier(t.name).store.get_many([object_key(other_tiers.key_prefix, other.chain[last_block])])[0]
    finally:
        other_tiers.close()


def _corruptions(tiers, t, p: Prompt, other: Prompt):
    """(name, mutate, reason) for the object ending at block 3 (RAM: block 3 alone; disk,
    Redis: blocks 2-3), each mutating what the tier holds under that key."""
    store, is_ram = t.store, t.name == "ram"
    key = object_key(tiers.key_prefix, p.chain[3])
    neighbour = object_key(tiers.key_prefix, p.chain[4 if is_ram else 5])
    first, n = (3, 1) if is_ram else (2, 2)
    manifest_hash = bytes(32) if is_ram else p.chain[-1]
    return [("bit flip", lambda: _flip(store, key), "checksum"),
            ("truncation", lambda: _put(store, key, store.get_many([key])[0][:-100]), "truncated"),
            ("swap", lambda: _swap(store, key, neighbour), "key"),
            ("wrong token ids", lambda: _put(store, key, _wrong_tokens_value(tiers, p, first, n, manifest_hash)),
             "tokens"),
            ("another model", lambda: _put(store, key, _other_model_value(t, other, 3)), "namespace")]


@pytest.mark.parametrize("kind", ["ram", "disk", "redis"])
def test_every_corruption_is_detected_deleted_and_never_served(kind, tmp_path, redis_server):
    spec = {"ram": TierSpec("ram", capacity_bytes=1 << 20),
            "disk": TierSpec("disk", 1 << 20, str(tmp_path / "d"), object_bytes=G_BYTES),
            "redis": TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES)}[kind]
    tokens = _tokens(40, seed=2)
    detected = []
    for case in range(5):
        tiers = _tiers([spec])
        t = tiers.tier(kind)
        p, other = Prompt(tokens), Prompt(tokens, weights="other")
        if kind == "ram":  # RAM holds one block per object: corrupt object "[3]" the same ways
            tiers.spill(p.spills(range(10)))
        else:
            tiers._write(t, p.job())
        name, mutate, reason = _corruptions(tiers, t, p, other)[case]
        mutate()
        pages, _ = _fetch_all(tiers, p)
        good = 3 if kind == "ram" else 2  # blocks before the bad object
        assert pages == p.pages[:good], name  # 0 bad bytes served: the prefix stops before it
        assert t.counters.integrity[reason] == 1, (name, dict(t.counters.integrity))
        assert _fetch_all(tiers, p)[0] == p.pages[:good]  # deleted: now a plain miss
        assert sum(t.counters.integrity.values()) == 1
        detected.append(name)
        t.store.delete([object_key(tiers.key_prefix, h) for h in p.chain])
        tiers.close()
    assert len(detected) == 5


def test_objects_without_their_commit_record_are_not_served(redis_server):
    tiers = _tiers([TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES)])
    try:
        p = Prompt(_tokens(24, seed=3))
        t = tiers.tier("redis")
        tiers._write(t, p.job())
        redis_server.client().delete(*redis_server.client().keys("*:m:*"))  # a store that died before its commit
        assert _fetch_all(tiers, p)[0] == []
        assert sum(t.counters.integrity.values()) == 0  # not corruption: just not committed
        assert not t.store.exists_many([object_key(tiers.key_prefix, p.chain[1])])[0]  # cleared for a rewrite
        tiers._write(t, p.job())
        assert _fetch_all(tiers, p)[0] == p.pages
    finally:
        tiers.close()


def test_redis_killed_opens_the_breaker_and_a_restart_closes_it(redis_server):
    tiers = _tiers([TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES, timeout_ms=200,
                             probe_interval_ms=100)])
    try:
        p = Prompt(_tokens(24, seed=4))
        t = tiers.tier("redis")
        tiers._write(t, p.job())
        redis_server.kill()
        for _ in range(3):
            assert _fetch_all(tiers, p)[0] == []  # each failure is a miss, fast
        assert t.breaker.state == "open"
        began = time.monotonic()
        assert _fetch_all(tiers, p)[0] == [] and time.monotonic() - began < 0.05  # refused without I/O
        tiers.store(p.job())
        assert tiers.stats()[0].num_dropped_stores == 1  # stores are dropped while open
        redis_server.start()  # an empty server on the same port: the probe closes the breaker
        deadline = time.monotonic() + 5
        while t.breaker.state != "closed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.breaker.state == "closed"
        tiers.store(p.job())
        assert tiers.flush(10)
        assert _fetch_all(tiers, p)[0] == p.pages  # hits resume
    finally:
        tiers.close()


def test_redis_hung_costs_at_most_the_breaker_threshold_of_timeouts(redis_server):
    tiers = _tiers([TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES, timeout_ms=150,
                             probe_interval_ms=100)])
    try:
        p = Prompt(_tokens(24, seed=5))
        tiers._write(tiers.tier("redis"), p.job())
        redis_server.stop()
        began = time.monotonic()
        for _ in range(10):
            assert _fetch_all(tiers, p)[0] == []
        assert time.monotonic() - began < 3 * 0.15 + 1.0  # three timeouts, then refused at once
        assert tiers.tier("redis").breaker.state == "open"
        redis_server.cont()
        deadline = time.monotonic() + 5
        while tiers.tier("redis").breaker.state != "closed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _fetch_all(tiers, p)[0] == p.pages
    finally:
        tiers.close()


def test_a_long_store_is_queued_in_parts_of_whole_objects(redis_server):
    from ctxwarden.kv.tiers.client import split_job

    p = Prompt(_tokens(4 * 23, seed=6))  # 23 blocks of 256 bytes
    parts = split_job(p.job(5, 23), blocks_per_object=2, max_bytes=4 * 256 + 100)  # 4 blocks a part
    assert [(j.first_block, len(j.chain)) for j in parts] == [(5, 8), (8, 12), (12, 16), (16, 20), (20, 23)]
    assert [bytes(x) for j in parts for x in j.pages] == p.pages[5:23]
    tiers = _tiers([TierSpec("redis", url=redis_server.url, object_bytes=G_BYTES,
                             max_queue_bytes=4 * (4 * 256 + 100))])
    try:
        tiers.store(p.job())  # 23 pages in 6 parts; at least 4 fit the queue at once
        assert tiers.flush(10)
        stats = tiers.stats()[0]
        assert stats.num_stores >= 4 and stats.num_stores + stats.num_dropped_stores == 6
        got = _fetch_all(tiers, p)[0]
        assert len(got) >= 16 and got == p.pages[:len(got)]  # whole parts, from the start
    finally:
        tiers.close()
