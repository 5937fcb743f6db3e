"""The byte stores on real memory, real files (a real tmpfs when full) and a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tier_faults import tmpfs

from ctxwarden.kv.tiers.breaker import CircuitBreaker
from ctxwarden.kv.tiers.stores import DiskStore, RamStore, RedisStore, TierUnavailable


def test_ram_store_lru_order_budget_and_pins():
    s = RamStore(capacity_bytes=30)
    assert s.put_many([("a", b"x" * 10), ("b", b"x" * 10), ("c", b"x" * 10)]) == 3
    assert s.get_many(["a"]) == [b"x" * 10]  # a is now the most recent
    assert s.put_many([("d", b"y" * 10)]) == 1  # evicts b, the least recently used
    assert s.exists_many(["a", "b", "c", "d"]) == [True, False, True, True]
    assert s.put_many([("a", b"z" * 10)]) == 0 and s.get_many(["a"]) == [b"x" * 10]  # put-if-absent
    assert s.put_many([("big", b"x" * 31)]) == 0 and s.used_bytes == 30  # never fits: nothing evicted
    s.pin("swap:r1", b"p" * 25)  # swap space evicts cached values to make room
    assert s.used_bytes == 25 + 0 and s.pinned_bytes == 25 and s.num_values == 0
    assert s.put_many([("e", b"x" * 10)]) == 0  # only 5 bytes left beside the pin
    assert s.unpin("swap:r1") == b"p" * 25 and s.used_bytes == 0


def test_disk_store_caps_bytes_lru_and_rebuilds_after_restart(tmp_path):
    d = DiskStore(tmp_path, capacity_bytes=300)
    d.put_many([(f"k:{i}", bytes([i]) * 100) for i in range(3)])
    d.get_many(["k:0"])  # k:0 most recent: k:1 goes first
    d.put_many([("k:3", b"3" * 100)])
    assert d.exists_many(["k:0", "k:1", "k:2", "k:3"]) == [True, False, True, True]
    assert d.used_bytes == 300 == sum(f.stat().st_size for f in tmp_path.glob("*/*"))
    again = DiskStore(tmp_path, capacity_bytes=300)  # a restart: the index comes from the files
    assert again.num_values == 3 and again.get_many(["k:2"]) == [b"\x02" * 100]
    smaller = DiskStore(tmp_path, capacity_bytes=150)  # a lower cap evicts at start-up
    assert smaller.num_values == 1 and smaller.used_bytes <= 150


def test_a_write_killed_midway_leaves_no_partial_object(tmp_path):
    """kill -9 while a big value is being written: after restart it is absent, never partial."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from ctxwarden.kv.tiers.stores import DiskStore
        d = DiskStore({str(tmp_path)!r}, 1 << 30)
        d.put_many([("done", b"d" * 1000)])
        real_open = open
        class Killing:  # dies after writing half of the value: a real SIGKILL mid-write
            def __init__(self, f): self.f = f
            def __enter__(self): return self
            def __exit__(self, *a): self.f.close()
            def write(self, b):
                self.f.write(b[:len(b) // 2]); self.f.flush(); os.kill(os.getpid(), signal.SIGKILL)
        import builtins
        builtins.open = lambda p, m="r", *a, **k: Killing(real_open(p, m, *a, **k)) if "w" in m else real_open(p, m, *a, **k)
        d.put_many([("half", b"h" * 10_000_000)])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert any(".tmp." in p.name for p in tmp_path.glob("*/*"))  # the interrupted temporary file
    d = DiskStore(tmp_path, 1 << 30)
    assert d.exists_many(["done", "half"]) == [True, False]
    assert d.num_removed_partial == 1 and not any(".tmp." in p.name for p in tmp_path.glob("*/*"))
    assert d.get_many(["done"]) == [b"d" * 1000]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs."""
    with tmpfs(tmp_path / "full", "1m") as mount:
        yield mount


def test_a_full_disk_drops_the_write_and_raises_tier_unavailable(small_tmpfs):
    d = DiskStore(small_tmpfs, capacity_bytes=64 * 1024 * 1024)  # the cap is above what the disk holds
    d.put_many([("fits", b"a" * 400_000)])
    with pytest.raises(TierUnavailable, match="No space left"):
        d.put_many([("too-big", b"b" * 900_000)])
    assert d.exists_many(["fits", "too-big"]) == [True, False]
    assert [p.name for p in small_tmpfs.glob("*/*")] == ["fits"]  # the partial file was removed
    assert d.get_many(["fits"]) == [b"a" * 400_000]


def test_redis_store_nx_pipelines_and_deadline(redis_server):
    r = RedisStore(redis_server.url, timeout_s=0.5, batch_objects=2)
    assert r.put_many([(f"k{i}", bytes([i]) * 10) for i in range(5)]) == 5
    assert r.put_many([("k0", b"new"), ("k9", b"9")]) == 1  # SET NX: k0 is kept
    assert r.get_many(["k0", "k9", "nope"]) == [b"\x00" * 10, b"9", None]
    assert r.exists_many(["k1", "zz"]) == [True, False]
    with pytest.raises(TierUnavailable, match="deadline"):
        r.get_many(["k1", "k2", "k3"], deadline_s=0.0)  # already past: nothing is sent
    r.delete(["k1"])
    assert r.exists_many(["k1"]) == [False]


def test_redis_store_fails_fast_when_killed_or_hung(redis_server):
    r = RedisStore(redis_server.url, timeout_s=0.2, batch_objects=8)
    r.put_many([("a", b"1")])
    redis_server.stop()  # hung: the socket wait is bounded by the timeout
    with pytest.raises(TierUnavailable, match="Timeout"):
        r.get_many(["a"])
    assert not r.ping()
    redis_server.cont()
    assert r.ping() and r.get_many(["a"]) == [b"1"]
    redis_server.kill()
    with pytest.raises(TierUnavailable):
        r.get_many(["a"])


def test_breaker_opens_after_failures_half_opens_and_closes():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=3, cooldown_s=2.0, clock=lambda: now[0])
    for _ in range(2):
        b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow() and b.num_opens == 1
    now[0] = 2.0
    assert b.state == "half_open" and b.allow() and not b.allow()  # one trial at a time
    b.record_failure()
    assert b.state == "open" and b.num_opens == 2
    now[0] = 4.5
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.allow()
