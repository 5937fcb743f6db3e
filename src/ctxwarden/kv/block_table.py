"""One sequence's block table for one layer group, and the sliding-window release rule.

Logical block j of a sequence holds tokens [j*bs, (j+1)*bs). A table maps j to a block id,
or to None once a sliding window has released it (or a prefix hit never needed it):

    full group      [b7][b2][b9][b4]                   every block held
    sliding, w=8    [--][--][b9][b4]   bs=4, 14 tokens  blocks wholly before the window: None
    sink S=4, w=8   [b7][--][b9][b4]                   the sink's blocks stay pinned

Release rule (the arithmetic of ctxwarden.plan.kv.group_blocks_needed, not a second
formula): a step that writes tokens [n, n+c) has queries reaching back to n - w + 1, so
before that step every block ending at or before n - w + 1 may go, except the first
cdiv(sink_tokens, bs) blocks in sink mode. What stays is at most the w - 1 + c tokens the
step reads, which straddle at most cdiv(w - 1 + c, bs) + 1 blocks, plus the sink blocks:
exactly group_blocks_needed(n + c, bs, w, sink_tokens, c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ctxwarden.plan.kv import cdiv


def first_needed_block(num_tokens: int, window_tokens: int, block_size: int) -> int:
    """First logical block a step starting at token `num_tokens` can read in a window."""
    return max(0, num_tokens - window_tokens + 1) // block_size


class BlockTable:
    """Logical block index -> block id (None = released) for one sequence in one group."""

    __slots__ = ("block_size", "window_tokens", "num_sink_blocks", "block_ids", "_num_checked")

    def __init__(self, block_size: int, window_tokens: int | None, sink_tokens: int,
                 block_ids: list[int | None] | None = None):
        self.block_size = block_size
        self.window_tokens = window_tokens
        self.num_sink_blocks = cdiv(sink_tokens, block_size) if window_tokens else 0
        self.block_ids: list[int | None] = block_ids if block_ids is not None else []
        # Blocks below this index (and at or past the sinks) have been released or checked:
        # release scans only new ground, so a decode step stays O(1).
        self._num_checked = self.num_sink_blocks

    @property
    def is_sliding(self) -> bool:
        """Whether blocks outside a window are released."""
        return self.window_tokens is not None

    def held_block_ids(self) -> list[int]:
        """Block ids the table holds, in logical order."""
        return [b for b in self.block_ids if b is not None]

    def num_blocks_to_grow(self, num_tokens: int) -> int:
        """New blocks needed so that the table covers `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.block_ids))

    def releasable_block_ids(self, num_tokens: int) -> list[int]:
        """Held blocks a step starting at `num_tokens` no longer reads, latest first."""
        if self.window_tokens is None:
            return []
        stop = min(first_needed_block(num_tokens, self.window_tokens, self.block_size),
                   len(self.block_ids))
        ids = self.block_ids
        return [ids[j] for j in range(stop - 1, self._num_checked - 1, -1) if ids[j] is not None]

    def release(self, num_tokens: int) -> list[int]:
        """Drop the blocks `releasable_block_ids` names from the table; return them."""
        released = self.releasable_block_ids(num_tokens)
        if self.window_tokens is None:
            return released
        stop = min(first_needed_block(num_tokens, self.window_tokens, self.block_size),
                   len(self.block_ids))
        for j in range(self._num_checked, stop):
            self.block_ids[j] = None
        self._num_checked = max(self._num_checked, stop)
        return released


@dataclass(frozen=True)
class BlockTables:
    """A sequence's block tables at one moment, one per layer group: a value, never mutated.

    `groups[g][j]` is the page of logical block j in group g; None where a window released
    it (or a prefix hit in a sliding group never needed it). This is what the scheduler
    hands the engine: the runner reads pages, a swap copies them.
    """

    groups: tuple[tuple[int | None, ...], ...]

    @classmethod
    def of(cls, tables: Iterable[Sequence[int | None]]) -> "BlockTables":
        """Freeze per-group lists (as `KVCacheManager.block_tables` returns them)."""
        return cls(tuple(tuple(t) for t in tables))

    def page_ids(self, filler: int = 0) -> tuple[tuple[int, ...], ...]:
        """The tables with released entries set to `filler` (the runner never reads them)."""
        return tuple(tuple(filler if b is None else b for b in t) for t in self.groups)

    def held(self) -> list[tuple[int, int, int]]:
        """(group, logical block, page) of every page held, group by group."""
        return [(g, j, b) for g, t in enumerate(self.groups) for j, b in enumerate(t) if b is not None]

    @property
    def num_held_blocks(self) -> int:
        """Pages held over every group."""
        return sum(b is not None for t in self.groups for b in t)
