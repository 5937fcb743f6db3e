"""Host swap space: the pages of requests preempted by swap, kept in host memory.

The scheduler decides who is swapped out and back in (and bounds the bytes); this class
only moves the bytes, once per step, before the forward pass:

    read every swapped-out page (preempted this step) -> host copies
    write every swapped-in page back (except leading blocks the prefix cache served)

Order matters: a page freed by a swap-out may be handed to a swap-in in the same step, so
every read happens before any write, and nothing is overwritten before the forward pass.
"""

from __future__ import annotations

from ctxwarden.runner.kv_cache import PageCopy, PagedKVCache
from ctxwarden.scheduler import SchedulerOutput


class HostSwapSpace:
    """Host copies of swapped-out requests' pages, keyed by (group, logical block)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self._pages: dict[str, dict[tuple[int, int], PageCopy]] = {}

    def move(self, out: SchedulerOutput) -> None:
        """Copy this step's preempted (swap) pages out, then swapped-in pages back."""
        for p in out.preempted:
            if p.mode == "swap":
                self._pages[p.request.request_id] = {
                    (g, j): self.cache.read_page(b) for g, j, b in p.block_tables.held()}
        for s in out.swapped_in:
            saved = self._pages.pop(s.request.request_id)
            for g, j, b in s.block_tables.held():
                if j >= s.num_hit_blocks and (g, j) in saved:
                    self.cache.write_page(b, saved[(g, j)])

    def drop(self, request_id: str) -> None:
        """Forget a request's host pages (it finished or was aborted while swapped out)."""
        self._pages.pop(request_id, None)

    @property
    def num_bytes(self) -> int:
        """Host bytes held by swapped-out pages."""
        return sum(p.nbytes for pages in self._pages.values() for p in pages.values())
