"""Host swap space: the pages of requests preempted by swap, kept in host memory.

The scheduler decides who is swapped out and back in (and bounds the bytes); this class
only moves the bytes, once per step, before the forward pass:

    read every swapped-out page (preempted this step) -> one pinned value per request
    write every swapped-in page back (except leading blocks the prefix cache served)

The bytes live in a kv.tiers RamStore: with a RAM tier configured it is the tier's own
store (swap pages are pinned in the same byte budget, evicting cached blocks to make room),
otherwise a private one. Order matters: a page freed by a swap-out may be handed to a
swap-in in the same step, so every read happens before any write, and nothing is
overwritten before the forward pass.
"""

from __future__ import annotations

import numpy as np

from ctxwarden.kv.tiers.stores import RamStore
from ctxwarden.runner.kv_cache import PagedKVCache
from ctxwarden.scheduler import SchedulerOutput


class HostSwapSpace:
    """Swapped-out requests' pages as pinned bytes; which (group, logical block) each row is."""

    def __init__(self, cache: PagedKVCache, store: RamStore | None = None):
        self.cache = cache
        self.store = store if store is not None else RamStore(capacity_bytes=1 << 62)
        self._rows: dict[str, list[tuple[int, int]]] = {}  # request -> (group, block) per row

    def move(self, out: SchedulerOutput) -> None:
        """Copy this step's preempted (swap) pages out, then swapped-in pages back."""
        for p in out.preempted:
            if p.mode == "swap":
                held = p.block_tables.held()
                pages = self.cache.read_pages([b for _, _, b in held])
                self.store.pin(_key(p.request.request_id), pages.tobytes())
                self._rows[p.request.request_id] = [(g, j) for g, j, _ in held]
        for s in out.swapped_in:
            self._write_back(s)

    def _write_back(self, s) -> None:
        rid = s.request.request_id
        rows = self._rows.pop(rid)
        data = np.frombuffer(self.store.unpin(_key(rid)), dtype=np.uint8).reshape(len(rows), -1)
        saved = {gj: i for i, gj in enumerate(rows)}
        targets = [(b, saved[(g, j)]) for g, j, b in s.block_tables.held()
                   if j >= s.num_hit_blocks and (g, j) in saved]
        if targets:
            self.cache.write_pages([b for b, _ in targets], [data[i] for _, i in targets])

    def drop(self, request_id: str) -> None:
        """Forget a request's host pages (it finished or was aborted while swapped out)."""
        if self._rows.pop(request_id, None) is not None:
            self.store.unpin(_key(request_id))

    @property
    def num_bytes(self) -> int:
        """Host bytes held by swapped-out pages."""
        return self.store.pinned_bytes


def _key(request_id: str) -> str:
    return f"swap:{request_id}"
