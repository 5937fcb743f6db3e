"""The tier client: find, fetch and verify, spill and store KV blocks as bytes (no torch).

    lookup(expected, start, end)  RAM, then disk, then Redis: each continues the prefix from
                                  where the previous one stopped -> TierRuns (objects to get)
    fetch(run, expected, deadline) get the objects (bounded batches), verify every header,
                                  page checksum and commit record -> pages up to the first bad,
                                  missing or late object (deleted if bad, counted by reason)
    spill(pages)                  blocks the pool evicted -> RAM objects (one block each)
    store(job)                    computed blocks -> disk and Redis writers (asynchronous,
                                  dropped when the queue is full or the breaker is open)

Objects group `blocks_per_object` consecutive blocks of one chain, aligned: object k holds
blocks [kG, kG + n) and is keyed by the chain hash of its last block, which names the whole
prefix, so a reader can compute every key. A store writes its objects, then its manifest
(the commit record: its objects and block digests under a Merkle root); a disk or Redis
object is only used once the manifest its header names has been found and checked. RAM
objects are written whole in this process and commit themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ctxwarden.kv.prefix import BlockHash
from ctxwarden.kv.tiers.breaker import CircuitBreaker
from ctxwarden.kv.tiers.config import TierSpec, TiersConfig
from ctxwarden.kv.tiers.cost import CostModel
from ctxwarden.kv.tiers.keys import TierNamespace, manifest_key, object_key
from ctxwarden.kv.tiers.stats import FETCH_BUCKETS_S, TierCounters, TierStats
from ctxwarden.kv.tiers.stores import DeadlinePassed, DiskStore, RamStore, RedisStore, TierUnavailable
from ctxwarden.kv.tiers.value import (NO_KEY, Expected, IntegrityError, Manifest, ObjectHeader,
                                      PageFormat, block_sum, decode_manifest, decode_object,
                                      encode_manifest, encode_object, merkle_root)
from ctxwarden.kv.tiers.writer import StoreWriter

log = logging.getLogger("ctxwarden.kv.tiers")


@dataclass(frozen=True)
class TierRun:
    """Blocks [first_block, end_block) of a prefix that one tier can supply, as objects."""

    tier: str
    first_block: int
    end_block: int
    objects: tuple[tuple[int, int], ...]  # (first block, num blocks), aligned, in order

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


@dataclass(frozen=True)
class FetchResult:
    """Verified pages of blocks [first_block, first_block + len(pages)) from one tier."""

    tier: str
    first_block: int
    pages: tuple[memoryview, ...]
    shortfall: str | None  # why it stopped before the run's end (None: it did not)
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class SpilledPage:
    """One block the pool evicted, with what identifies it, and its page's bytes."""

    root: bytes
    block_index: int
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    page: bytes | memoryview


@dataclass(frozen=True)
class StoreJob:
    """Computed blocks [first_block, len(chain)) of one sequence, to write through."""

    root: bytes
    chain: tuple[BlockHash, ...]  # hashes of blocks 0 .. end-1
    token_ids: tuple[int, ...]  # tokens of blocks 0 .. end-1
    first_block: int
    pages: tuple[bytes | memoryview, ...]  # one per block from first_block

    @property
    def num_bytes(self) -> int:
        return sum(len(p) for p in self.pages)


class _Tier:
    """One configured tier: its store, breaker, counters, object size and writer."""

    def __init__(self, spec: TierSpec, store, page: PageFormat):
        self.spec, self.name, self.store = spec, spec.kind, store
        self.breaker = CircuitBreaker(cooldown_s=max(1.0, 4 * spec.probe_interval_ms / 1000))
        # A full or failing disk still reads: its writes stop at the first error (the tier is
        # "degraded") and are tried again after a cooldown. Redis has one breaker for both.
        self.write_breaker = CircuitBreaker(1, 10.0) if spec.kind == "disk" else self.breaker
        # Stores run in the background with megabyte values: their socket waits may be longer
        # than a fetch's, which a request is waiting on.
        self.write_store = RedisStore(spec.url, 8 * spec.timeout_ms / 1000, spec.batch_objects) \
            if spec.kind == "redis" else store
        self.counters = TierCounters()
        self.blocks_per_object = 1 if spec.kind == "ram" else max(1, spec.object_bytes // page.page_bytes)
        self.requires_manifest = spec.kind != "ram"
        self.writer: StoreWriter | None = None


def open_store(spec: TierSpec):
    """The byte store a spec names (RAM, a directory, a Redis URL)."""
    if spec.kind == "ram":
        return RamStore(spec.capacity_bytes)
    if spec.kind == "disk":
        return DiskStore(spec.path, spec.capacity_bytes)
    return RedisStore(spec.url, spec.timeout_ms / 1000, spec.batch_objects)


class KVTiers:
    """Every configured tier of one engine, for one model namespace and page format."""

    def __init__(self, config: TiersConfig, namespace: TierNamespace, page: PageFormat,
                 block_size: int, cost: CostModel | None = None):
        self.namespace, self.page, self.block_size = namespace, page, block_size
        self.key_prefix = namespace.key_prefix
        self.cost = cost or CostModel()
        self.tiers = [_Tier(spec, open_store(spec), page) for spec in config.tiers]
        self._stop = threading.Event()
        for t in self.tiers:
            if t.name != "ram":
                t.writer = StoreWriter(t.name, t.spec.max_queue_bytes, lambda job, t=t: self._write(t, job))
        self._prober = threading.Thread(target=self._probe_loop, name="kv-tier-probe", daemon=True)
        if any(isinstance(t.store, RedisStore) for t in self.tiers):
            self._prober.start()

    def tier(self, name: str) -> _Tier | None:
        """The configured tier of that kind, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def has_ram(self) -> bool:
        return self.tier("ram") is not None

    # --- lookup -----------------------------------------------------------------------------

    def lookup(self, exp: Expected, start_block: int, end_block: int) -> list[TierRun]:
        """Where blocks [start_block, end_block) can come from: one run per tier, chained."""
        runs, at = [], start_block
        for t in self.tiers:
            if at >= end_block:
                break
            run = self._lookup_one(t, exp, at, end_block)
            if run is not None:
                runs.append(run)
                at = run.end_block
        return runs

    def _lookup_one(self, t: _Tier, exp: Expected, start: int, end: int) -> TierRun | None:
        if not t.breaker.allow():
            return None
        keys = [object_key(self.key_prefix, exp.chain[j]) for j in range(start, end)]
        began = time.monotonic()
        try:
            present = t.store.exists_many(keys, began + t.spec.timeout_ms / 1000)
        except TierUnavailable as e:
            self._failed(t, "lookup", e)
            return None
        t.breaker.record_success()
        self.cost.observe_latency(t.name, time.monotonic() - began)
        objects = _path(present, start, end, t.blocks_per_object)
        found_end = objects[-1][0] + objects[-1][1] if objects else start
        t.counters.add(num_lookups=1, num_miss_blocks=end - found_end)
        return TierRun(t.name, start, found_end, tuple(objects)) if objects else None

    # --- fetch ------------------------------------------------------------------------------

    def fetch(self, run: TierRun, exp: Expected, deadline_s: float) -> FetchResult:
        """Get, verify and return the run's pages, stopping at the first bad, missing or late one.

        Late means past `deadline_s`, or projected past it: after each batch the rest of the
        run is timed at the rate measured so far, and abandoned at once if it would finish
        after the deadline (a slow link costs one batch, not the whole break-even time).
        """
        t, began = self.tier(run.tier), time.monotonic()
        pages: list[memoryview] = []
        shortfall = None
        manifests: dict[bytes, Manifest | None] = {}
        batch = t.spec.batch_objects
        for i in range(0, len(run.objects), batch):
            if self._is_late(began, len(pages), run.num_blocks, deadline_s):
                shortfall = "deadline"
                break
            got, shortfall = self._fetch_batch(t, run.objects[i:i + batch], exp, deadline_s, manifests)
            for first, views in got:
                pages.extend(views[max(0, run.first_block + len(pages) - first):])
            if shortfall:
                break
        num_bytes = sum(len(p) for p in pages)
        self._count_fetch(t, run, len(pages), num_bytes, time.monotonic() - began, shortfall)
        return FetchResult(run.tier, run.first_block, tuple(pages), shortfall, num_bytes)

    @staticmethod
    def _is_late(began: float, num_done: int, num_blocks: int, deadline_s: float) -> bool:
        now = time.monotonic()
        if num_done == 0 or now > deadline_s:
            return now > deadline_s
        return now + (num_blocks - num_done) * (now - began) / num_done > deadline_s

    def _fetch_batch(self, t: _Tier, objects, exp: Expected, deadline_s: float,
                     manifests: dict) -> tuple[list[tuple[int, list[memoryview]]], str | None]:
        """Verified (first block, pages) of a batch's leading good objects, and why it stopped."""
        keys = [object_key(self.key_prefix, exp.chain[f + n - 1]) for f, n in objects]
        try:
            values = t.store.get_many(keys, deadline_s)
        except DeadlinePassed:
            return [], "deadline"
        except TierUnavailable as e:
            self._failed(t, "fetch", e)
            return [], "unavailable"
        t.breaker.record_success()
        out = []
        for (first, n), key, value in zip(objects, keys, values):
            if value is None:
                return out, "missing"
            began = time.perf_counter()
            try:
                header, views = decode_object(value, exp, first, n)
                if t.requires_manifest and not self._committed(t, header, exp, manifests):
                    t.store.delete([key])  # never committed (or its record is gone): a miss
                    return out, "uncommitted"
            except IntegrityError as e:
                self._bad_value(t, key, e)
                return out, "integrity"
            except TierUnavailable as e:
                self._failed(t, "fetch", e)
                return out, "unavailable"
            finally:
                t.counters.add(verify_seconds=time.perf_counter() - began)
            out.append((first, views))
        return out, None

    def _committed(self, t: _Tier, h: ObjectHeader, exp: Expected, manifests: dict) -> bool:
        """Whether the manifest the object names exists, verifies, and vouches for its blocks."""
        if h.manifest_key == NO_KEY:
            raise IntegrityError("manifest", "a shared-tier object names no commit record")
        record = (h.manifest_key, h.store_root)
        if record not in manifests:
            manifests[record] = self._read_manifest(t, h.manifest_key, h.store_root, exp.root)
        m = manifests[record]
        if m is None:
            return False
        listed = (h.own_key, h.first_block, h.num_blocks) in m.objects
        at = h.first_block - m.first_block
        if not listed or m.store_root != h.store_root or m.block_sums[at:at + h.num_blocks] != h.block_sums:
            raise IntegrityError("manifest", f"the commit record does not vouch for blocks "
                                 f"{h.first_block}..{h.first_block + h.num_blocks - 1}")
        return True

    def _read_manifest(self, t: _Tier, own_key: BlockHash, store_root: bytes, root: bytes) -> Manifest | None:
        """The commit record (one small GET, not cut by the deadline: the objects it vouches
        for have already arrived)."""
        key = manifest_key(self.key_prefix, own_key, store_root)
        value = t.store.get_many([key])[0]
        if value is None:
            return None
        try:
            return decode_manifest(value, root, own_key)
        except IntegrityError as e:
            self._bad_value(t, key, e)
            return None

    def _bad_value(self, t: _Tier, key: str, e: IntegrityError) -> None:
        """Count, log and delete a value that failed verification (it is then a miss)."""
        t.counters.count_integrity(e.reason)
        log.warning("kv tier %s: %s failed verification (%s); deleted, recomputing", t.name, key, e)
        try:
            t.store.delete([key])
        except TierUnavailable:
            pass

    def _count_fetch(self, t: _Tier, run: TierRun, num_blocks: int, num_bytes: int, seconds: float,
                     shortfall: str | None) -> None:
        t.counters.add(num_hit_blocks=num_blocks, num_miss_blocks=run.num_blocks - num_blocks,
                       bytes_out=num_bytes)
        t.counters.observe_fetch(seconds)
        if num_bytes:  # a fetch cut short still measured the link: the next decision knows
            self.cost.observe_fetch(t.name, num_bytes, seconds, 1 + len(run.objects) // t.spec.batch_objects)
        if shortfall is not None:
            t.counters.count_decision("recompute")
            log.info("kv tier %s: fetch stopped at block %d of %d..%d (%s); recomputing the rest",
                     t.name, run.first_block + num_blocks, run.first_block, run.end_block - 1, shortfall)

    def _failed(self, t: _Tier, what: str, e: Exception, breaker: CircuitBreaker | None = None) -> None:
        breaker = breaker or t.breaker
        breaker.record_failure()
        t.counters.add(num_errors=1)
        log.warning("kv tier %s: %s failed (%s); breaker %s", t.name, what, e, breaker.state)

    def count_decision(self, tier: str, action: str) -> None:
        """Record one request's fetch / skipped decision for a tier (the scheduler decides)."""
        self.tier(tier).counters.count_decision(action)

    # --- spill and store ---------------------------------------------------------------------

    def spill(self, pages: Sequence[SpilledPage]) -> int:
        """Put evicted blocks into the RAM tier (one self-committed object each); how many fit."""
        t = self.tier("ram")
        if t is None or not pages:
            return 0
        items = [(object_key(self.key_prefix, p.block_hash), self._ram_object(p)) for p in pages]
        stored = t.store.put_many(items)
        t.counters.add(num_stores=len(items), bytes_in=sum(len(v) for _, v in items))
        return stored

    def _ram_object(self, p: SpilledPage) -> bytes:
        s = block_sum(p.page)
        h = ObjectHeader(p.root, p.block_hash, p.parent_hash, merkle_root([s]), NO_KEY, p.block_index, 1, (s,))
        return encode_object(h, self.block_size, self.page, p.token_ids, [p.page])

    def ram_store(self) -> RamStore | None:
        """The RAM tier's store (swap space shares it), or None without a RAM tier."""
        t = self.tier("ram")
        return t.store if t is not None else None

    def store(self, job: StoreJob) -> None:
        """Hand computed blocks to every write-through tier (disk, Redis); never blocks.

        A long sequence is cut into stores of at most a quarter of the tier's queue budget
        (whole objects each, each with its own commit record), so one 8K-token prompt is
        queued in parts instead of being dropped whole.
        """
        for t in self.tiers:
            if t.writer is None:
                continue
            for part in split_job(job, t.blocks_per_object, t.spec.max_queue_bytes // 4):
                if not t.write_breaker.allow() or not t.writer.submit(part):
                    t.counters.add(num_dropped_stores=1)

    def _write(self, t: _Tier, job: StoreJob) -> None:
        """On the tier's writer thread: encode the job's objects, write the new ones, then the manifest."""
        g = t.blocks_per_object
        start = (job.first_block // g) * g
        if start < job.first_block:
            start += g  # the group that holds first_block lacks its head pages: begin at the next
        end = len(job.chain)
        if start >= end:
            return
        objects, manifest = self._encode_store(t, job, start, end)
        try:
            keys = [k for k, _ in objects]
            present = t.write_store.exists_many(keys)
            new = [item for item, p in zip(objects, present) if not p]
            t.write_store.put_many(new)
            t.write_store.put_many([manifest])  # last: the commit record
        except TierUnavailable as e:
            self._failed(t, "store", e, t.write_breaker)
            t.counters.add(num_store_errors=1)
            return
        t.write_breaker.record_success()
        t.counters.add(num_stores=1, bytes_in=sum(len(v) for _, v in new) + len(manifest[1]))

    def _encode_store(self, t: _Tier, job: StoreJob, start: int, end: int):
        """(key, value) of every object of blocks [start, end) and of their manifest."""
        g, bs = t.blocks_per_object, self.block_size
        pages = job.pages[start - job.first_block:]
        sums = [block_sum(p) for p in pages]
        store_root, last = merkle_root(sums), job.chain[end - 1]
        objects, entries = [], []
        for first in range(start, end, g):
            n = min(g, end - first)
            own = job.chain[first + n - 1]
            h = ObjectHeader(job.root, own, job.root if first == 0 else job.chain[first - 1], store_root,
                             last, first, n, tuple(sums[first - start:first - start + n]))
            value = encode_object(h, bs, self.page, job.token_ids[first * bs:(first + n) * bs],
                                  pages[first - start:first - start + n])
            objects.append((object_key(self.key_prefix, own), value))
            entries.append((own, first, n))
        m = Manifest(job.root, last, store_root, start, tuple(entries), tuple(sums))
        return objects, (manifest_key(self.key_prefix, last, store_root), encode_manifest(m))

    # --- health, stats, shutdown ---------------------------------------------------------------

    def _probe_loop(self) -> None:
        """Ping tripped Redis tiers; a PING answered in time closes the breaker."""
        interval = min(t.spec.probe_interval_ms for t in self.tiers) / 1000
        while not self._stop.wait(interval):
            for t in self.tiers:
                if isinstance(t.store, RedisStore) and t.breaker.state != "closed" and t.store.ping():
                    log.info("kv tier %s: health probe answered; breaker closed", t.name)
                    t.breaker.record_success()

    def stats(self) -> tuple[TierStats, ...]:
        """A snapshot of every tier's numbers."""
        return tuple(_snapshot(t) for t in self.tiers)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued store is written (tests, benchmarks, shutdown)."""
        return all(t.writer.flush(timeout_s) for t in self.tiers if t.writer is not None)

    def close(self) -> None:
        """Stop the writers and the probe, close connections (queued stores are dropped)."""
        self._stop.set()
        for t in self.tiers:
            if t.writer is not None:
                t.writer.close()
            if isinstance(t.store, RedisStore):
                t.store.close()
                t.write_store.close()


def split_job(job: StoreJob, blocks_per_object: int, max_bytes: int) -> list[StoreJob]:
    """`job` cut at multiples of a whole number of objects holding at most `max_bytes`."""
    if not job.pages:
        return []
    page_bytes = len(job.pages[0])
    step = max(1, max_bytes // page_bytes // blocks_per_object) * blocks_per_object
    end, bs = len(job.chain), len(job.token_ids) // len(job.chain)
    cuts = list(range((job.first_block // step + 1) * step, end, step)) + [end]
    parts, first = [], job.first_block
    for cut in cuts:
        parts.append(StoreJob(job.root, job.chain[:cut], job.token_ids[:cut * bs], first,
                              job.pages[first - job.first_block:cut - job.first_block]))
        first = cut
    return parts


def _path(present: Sequence[bool], start: int, end: int, g: int) -> list[tuple[int, int]]:
    """Objects that continue a prefix from `start`: whole aligned groups, then at most one
    partial group (its longest present end); `present[j - start]` says if object h[j] exists."""
    objects, at = [], start
    while at < end:
        group = (at // g) * g
        full_end = group + g - 1
        if full_end < end and present[full_end - start]:
            objects.append((group, g))
            at = full_end + 1
            continue
        for j in range(min(full_end, end - 1), at - 1, -1):
            if present[j - start]:
                objects.append((group, j - group + 1))
                break
        break
    return objects


def _snapshot(t: _Tier) -> TierStats:
    c = t.counters
    with c.lock:
        counts = dict(c.counts)
        return TierStats(
            tier=t.name, breaker_state=t.breaker.state, is_degraded=t.write_breaker.state != "closed",
            num_breaker_opens=t.breaker.num_opens + (t.write_breaker.num_opens if t.write_breaker is not t.breaker else 0),
            num_lookups=counts.get("num_lookups", 0), num_hit_blocks=counts.get("num_hit_blocks", 0),
            num_miss_blocks=counts.get("num_miss_blocks", 0), bytes_in=counts.get("bytes_in", 0),
            bytes_out=counts.get("bytes_out", 0), fetch_bucket_counts=tuple(c.fetch_buckets),
            fetch_seconds_sum=c.fetch_seconds_sum, num_fetches=counts.get("num_fetches", 0),
            verify_seconds_sum=counts.get("verify_seconds", 0.0),
            integrity_failures=tuple(sorted(c.integrity.items())), decisions=tuple(sorted(c.decisions.items())),
            num_stores=counts.get("num_stores", 0), num_dropped_stores=counts.get("num_dropped_stores", 0),
            num_store_errors=counts.get("num_store_errors", 0), used_bytes=getattr(t.store, "used_bytes", 0),
            capacity_bytes=t.spec.capacity_bytes, num_values=getattr(t.store, "num_values", 0))


__all__ = ["FETCH_BUCKETS_S", "FetchResult", "KVTiers", "SpilledPage", "StoreJob", "TierRun", "open_store"]
