"""Byte stores: host RAM, one local directory, Redis. Keys are str, values bytes (no torch).

Each store does only what a key-value store does (get, exists, put-if-absent, delete) and
keeps its own byte accounting; what the bytes mean is ctxwarden.kv.tiers.client's business.
A store that cannot answer raises TierUnavailable; the caller's breaker counts it.

- RamStore: an LRU dict under a hard byte budget; `pin` holds swapped-out pages in the same
  budget (pinned bytes are never evicted; cached ones make room for them).
- DiskStore: one file per key under a hard byte cap with LRU. A write goes to a temporary
  file in the same directory, then os.replace: a reader never sees a partial object. ENOSPC
  or any I/O error drops the write (the caller marks the tier degraded). On start the index
  is rebuilt from the files (oldest first) and leftover temporary files are deleted.
- RedisStore: redis-py, pipelined in bounded batches, SET NX, every socket wait bounded.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

_TMP_MARK = ".tmp."


class TierUnavailable(OSError):
    """The store could not answer (down, hung, full disk, I/O error)."""


class DeadlinePassed(TierUnavailable):
    """The caller's deadline passed before all of a request was sent (not the store's fault)."""


class RamStore:
    """Values in host memory: LRU under `capacity_bytes`, plus pinned (swap) entries."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self._pinned: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.used_bytes = 0  # cached + pinned
        self.pinned_bytes = 0  # swap space: never evicted
        self.num_evictions = 0

    def get_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bytes | None]:
        """Values of `keys` (None where absent); a hit moves the key to the LRU tail."""
        with self._lock:
            out = []
            for k in keys:
                v = self._lru.get(k)
                if v is not None:
                    self._lru.move_to_end(k)
                out.append(v)
            return out

    def exists_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bool]:
        """Whether each key is held (no LRU update)."""
        with self._lock:
            return [k in self._lru for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store absent keys (put-if-absent), evicting LRU values; returns how many were stored."""
        stored = 0
        with self._lock:
            for key, value in items:
                if key in self._lru or not self._make_room(len(value)):
                    continue
                self._lru[key] = value
                self.used_bytes += len(value)
                stored += 1
        return stored

    def _make_room(self, num_bytes: int) -> bool:
        """Evict LRU values until `num_bytes` fit; False (evicting nothing) if they never can."""
        if num_bytes > self.capacity_bytes - self.pinned_bytes:
            return False
        self._evict_to(self.capacity_bytes - num_bytes)
        return True

    def _evict_to(self, max_bytes: int) -> None:
        """Evict LRU values until at most `max_bytes` are used or none are left (lock held)."""
        while self.used_bytes > max_bytes and self._lru:
            _, old = self._lru.popitem(last=False)
            self.used_bytes -= len(old)
            self.num_evictions += 1

    def delete(self, keys: Sequence[str]) -> None:
        """Drop cached keys (absent ones are ignored)."""
        with self._lock:
            for k in keys:
                v = self._lru.pop(k, None)
                if v is not None:
                    self.used_bytes -= len(v)

    def pin(self, key: str, value: bytes) -> None:
        """Hold `value` until `unpin` (swap space): cached values are evicted to make room;
        pinned bytes may exceed the budget (the scheduler bounds swap space itself)."""
        with self._lock:
            self._evict_to(self.capacity_bytes - len(value))
            old = self._pinned.pop(key, None)
            delta = len(value) - (len(old) if old is not None else 0)
            self.used_bytes += delta
            self.pinned_bytes += delta
            self._pinned[key] = value

    def unpin(self, key: str) -> bytes | None:
        """Release a pinned value and return it (None if it was not pinned)."""
        with self._lock:
            value = self._pinned.pop(key, None)
            if value is not None:
                self.used_bytes -= len(value)
                self.pinned_bytes -= len(value)
            return value

    @property
    def num_values(self) -> int:
        """Cached (unpinned) values held."""
        return len(self._lru)


class DiskStore:
    """One file per key in `directory`, at most `capacity_bytes` in all, LRU."""

    def __init__(self, directory: str | Path, capacity_bytes: int):
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._tmp_ids = itertools.count()
        self.used_bytes = 0
        self.num_evictions = 0
        self.num_removed_partial = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    def _path(self, key: str) -> Path:
        name = key.replace(":", "_")
        return self.directory / name[-2:] / name

    def _rebuild_index(self) -> None:
        """Index the files already here (oldest first); delete interrupted temporary files."""
        found = []
        for path in self.directory.glob("*/*"):
            if _TMP_MARK in path.name:
                path.unlink(missing_ok=True)
                self.num_removed_partial += 1
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, path.name.replace("_", ":"), st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._evict_to(self.capacity_bytes)  # the cap may have been lowered since

    def get_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bytes | None]:
        """Values of `keys` (None where absent). An unreadable file raises TierUnavailable."""
        out = []
        for key in keys:
            with self._lock:
                present = key in self._index
                if present:
                    self._index.move_to_end(key)
            out.append(self._read(key) if present else None)
        return out

    def _read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:  # evicted by another process sharing the directory
            self._forget(key)
            return None
        except OSError as e:
            raise TierUnavailable(f"disk tier: reading {key}: {e}") from e

    def exists_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bool]:
        """Whether each key is in the index."""
        with self._lock:
            return [k in self._index for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Write absent keys (temp file, then rename); raises TierUnavailable on an I/O error
        (ENOSPC included) after removing the partial file."""
        stored = 0
        for key, value in items:
            with self._lock:
                if key in self._index or len(value) > self.capacity_bytes:
                    continue
                self._evict_to(self.capacity_bytes - len(value))
            self._write(key, value)
            with self._lock:
                self._index[key] = len(value)
                self.used_bytes += len(value)
            stored += 1
        return stored

    def _write(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}.{next(self._tmp_ids)}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)  # atomic: the name shows the whole object or nothing
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TierUnavailable(f"disk tier: writing {key}: {e}") from e

    def _evict_to(self, max_bytes: int) -> None:
        """Delete LRU files until at most `max_bytes` are used (lock held)."""
        while self.used_bytes > max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self.num_evictions += 1
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys and their files."""
        for key in keys:
            self._forget(key)
            self._path(key).unlink(missing_ok=True)

    @property
    def num_values(self) -> int:
        """Files indexed."""
        return len(self._index)


class RedisStore:
    """A Redis server through redis-py: bounded pipelines, SET NX, bounded socket waits."""

    def __init__(self, url: str, timeout_s: float, batch_objects: int):
        import redis  # imported here: only a configured Redis tier needs it

        self._errors = (redis.RedisError, OSError)
        self.batch_objects = batch_objects
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)
        self.url = url

    def _pipelined(self, commands, deadline_s: float | None) -> list:
        """Run (method, args) commands in pipelines of `batch_objects`, checking the deadline."""
        out = []
        try:
            for start in range(0, len(commands), self.batch_objects):
                if deadline_s is not None and time.monotonic() > deadline_s:
                    raise DeadlinePassed(f"redis tier: deadline passed after {len(out)} of {len(commands)} commands")
                pipe = self.client.pipeline(transaction=False)
                for method, args, kwargs in commands[start:start + self.batch_objects]:
                    getattr(pipe, method)(*args, **kwargs)
                out.extend(pipe.execute())
        except self._errors as e:
            raise TierUnavailable(f"redis tier ({self.url}): {type(e).__name__}: {e}") from e
        return out

    def get_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bytes | None]:
        """GET each key, `batch_objects` per round trip."""
        return self._pipelined([("get", (k,), {}) for k in keys], deadline_s)

    def exists_many(self, keys: Sequence[str], deadline_s: float | None = None) -> list[bool]:
        """EXISTS for every key in one round trip (small replies)."""
        if not keys:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]
        except self._errors as e:
            raise TierUnavailable(f"redis tier ({self.url}): {type(e).__name__}: {e}") from e

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """SET NX each value; returns how many keys were new."""
        results = self._pipelined([("set", (k, v), {"nx": True}) for k, v in items], None)
        return sum(1 for r in results if r)

    def delete(self, keys: Sequence[str]) -> None:
        """DEL keys (a failure is ignored: a bad value also fails verification next time)."""
        if keys:
            try:
                self.client.delete(*keys)
            except self._errors:
                pass

    def ping(self) -> bool:
        """The health probe: PING answered in time."""
        try:
            return bool(self.client.ping())
        except self._errors:
            return False

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
