"""Layouts for the KV tests, built without a model: the manager only needs a KVLayout."""

import pytest

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


@pytest.fixture
def clock():
    return FakeClock()
