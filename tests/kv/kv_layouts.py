"""Helpers for the KV tests (layouts built without a model, a settable clock, pool rows).

A module of its own, not conftest.py: test files import it by name, which a conftest cannot
be relied on for when several test folders are collected together.
"""

from ctxwarden.plan.kv import KVGroup, KVLayout


def uniform_layout(block_size: int = 4) -> KVLayout:
    """One full-attention group: the classic paged cache (llama-like)."""
    return KVLayout((KVGroup("full", (0, 1), None),), block_size, 64)


def hybrid_layout(block_size: int = 4, window_tokens: int = 8) -> KVLayout:
    """A full group and a sliding group (gemma2-like alternation)."""
    return KVLayout((KVGroup("full", (1, 3), None), KVGroup("sliding", (0, 2), window_tokens)),
                    block_size, 64)


def sink_layout(block_size: int = 4, window_tokens: int = 8, sink_tokens: int = 4) -> KVLayout:
    """Sink mode: every layer keeps the first sink_tokens tokens plus a rolling window."""
    return KVLayout((KVGroup("sliding", (0, 1), window_tokens),), block_size, 64, sink_tokens)


class FakeClock:
    """A settable nanosecond clock, so ages and risk levels are exact."""

    def __init__(self):
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def advance_ms(self, ms: float) -> None:
        self.now_ns += int(ms * 1e6)



def slots(m, seq_id, start_pos: int, stop_pos: int, group_index: int = 0) -> list[int]:
    """Pool rows of positions [start_pos, stop_pos) of one group, as the runner computes them
    (page * block_size + offset) from the manager's block tables. LookupError where a window
    released the block or the position has no slot yet."""
    if not 0 <= start_pos <= stop_pos <= m.num_tokens(seq_id):
        raise LookupError(f"positions [{start_pos}, {stop_pos}) are outside the slotted tokens")
    table, bs = m.block_tables(seq_id)[group_index], m.block_size
    out = []
    for p in range(start_pos, stop_pos):
        if table[p // bs] is None:
            raise LookupError(f"position {p} lies in a block the window released")
        out.append(table[p // bs] * bs + p % bs)
    return out
