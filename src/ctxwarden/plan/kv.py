"""KV-cache arithmetic: bytes per token, layer groups, and blocks needed per sequence.

This module is the single source of the numbers that the planner prints, that admission
uses to refuse a request, and that the block manager and the runner allocate. Nothing here
imports torch; every function is pure.

Layout of the paged pool (one pool, pages of equal size):

    group 0 (full layers 1,3,5 ...)   seq A: [b7][b2][b9]...      page = block_size tokens x
    group 1 (sliding layers 0,2,4 ..)  seq A: [b4][b11]  (rolls)         the group's layers

Layers are split into *groups* of equal layer count, each group one kind (full, sliding
with a window, or MLA). A sequence holds one block table per group; a block (a page) holds
`block_size` tokens of K and V for every layer of its group. Because every group has the same
number of layers of the same per-layer size, every page has the same byte size, so one free
list serves all groups and a sliding group's released blocks are reusable by a full group.
A uniform model (llama) has one group holding all its layers: the classic paged cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ctxwarden.spec.dtypes import DTYPES, KV_DTYPES, canonical_dtype
from ctxwarden.spec.model_spec import SLIDING, ModelSpec

FULL_KIND, SLIDING_KIND, MLA_KIND = "full", "sliding", "mla"
# fp8 KV stores each cached row (one token's K or V of one KV head, or MLA's latent row)
# with one scale byte: a power-of-two exponent (runner/kv_quant.py says why).
KV_SCALE_BYTES_PER_ROW = {"fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per cached element for a KV dtype name (bf16, fp16, fp32, fp8, or torch names)."""
    return DTYPES[canonical_dtype(kv_dtype, KV_DTYPES, "kv dtype")].num_bytes


def kv_row_bytes(width: int, kv_dtype: str) -> int:
    """Bytes of one cached row of `width` elements, its scale included (fp8)."""
    scale = KV_SCALE_BYTES_PER_ROW.get(canonical_dtype(kv_dtype, KV_DTYPES, "kv dtype"), 0)
    return width * kv_dtype_bytes(kv_dtype) + scale


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """Bytes one token costs in one attention layer: K and V (or MLA's latent + rope key)."""
    if spec.mla is not None:
        return kv_row_bytes(spec.mla.cache_dim, kv_dtype)
    return 2 * spec.num_kv_heads * kv_row_bytes(spec.head_dim, kv_dtype)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """Bytes one token costs summed over every layer that stores it."""
    return spec.num_layers * layer_kv_bytes_per_token(spec, kv_dtype)


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one block table per sequence. All groups of a layout have equal size."""

    kind: str  # full | sliding | mla
    layer_ids: tuple[int, ...]
    window_tokens: int | None  # tokens a query attends back over; None = the whole sequence

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


@dataclass(frozen=True)
class KVLayout:
    """How a model's KV cache is cut into pages. Built once by `kv_layout`."""

    groups: tuple[KVGroup, ...]
    block_size: int
    layer_bytes_per_token: int
    sink_tokens: int = 0

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        sizes = {g.num_layers for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"every KV group must hold the same number of layers, got {sorted(sizes)}")

    @property
    def layers_per_group(self) -> int:
        return self.groups[0].num_layers

    @property
    def page_bytes(self) -> int:
        """Bytes of one block: block_size tokens of every layer in one group."""
        return self.block_size * self.layers_per_group * self.layer_bytes_per_token

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def kv_layout(spec: ModelSpec, kv_dtype: str, block_size: int = 16,
              window_tokens: int | None = None, sink_tokens: int = 0) -> KVLayout:
    """Cut a model's layers into equal-size groups by kind.

    `window_tokens` with `sink_tokens` selects sink mode (StreamingLLM): every layer keeps
    the first `sink_tokens` tokens plus a rolling window, whatever its own kind.
    """
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    if sink_tokens and not window_tokens:
        raise ValueError("sink mode needs window_tokens (the rolling window after the sinks)")
    kinds = [_layer_kind(spec, i, window_tokens) for i in range(spec.num_layers)]
    by_kind: dict[tuple[str, int | None], list[int]] = {}
    for i, k in enumerate(kinds):
        by_kind.setdefault(k, []).append(i)
    size = math.gcd(*(len(ids) for ids in by_kind.values()))
    groups = []
    for (kind, window), ids in by_kind.items():
        for start in range(0, len(ids), size):
            groups.append(KVGroup(kind, tuple(ids[start:start + size]), window))
    return KVLayout(tuple(groups), block_size, layer_kv_bytes_per_token(spec, kv_dtype), sink_tokens)


def _layer_kind(spec: ModelSpec, layer_id: int, window_override: int | None) -> tuple[str, int | None]:
    if window_override:
        return SLIDING_KIND, window_override
    if spec.layer_types[layer_id] == SLIDING:
        return SLIDING_KIND, spec.sliding_window
    return (MLA_KIND if spec.mla is not None else FULL_KIND), None


def group_blocks_needed(num_tokens: int, block_size: int, window_tokens: int | None = None,
                        sink_tokens: int = 0, chunk_tokens: int = 1) -> int:
    """Blocks one group must hold at once for a sequence of `num_tokens` tokens.

    Full attention holds every token. A sliding window of w tokens, while a step writes up
    to `chunk_tokens` new tokens, needs the w - 1 tokens before the chunk plus the chunk:
    w - 1 + chunk tokens, which can straddle one more block than they fill. Sink mode keeps
    the first `sink_tokens` tokens' blocks pinned on top of that.
    """
    if num_tokens <= 0:
        return 0
    every = cdiv(num_tokens, block_size)
    if window_tokens is None:
        return every
    sink_blocks = cdiv(sink_tokens, block_size)
    rolling = cdiv(window_tokens - 1 + max(chunk_tokens, 1), block_size) + 1
    return min(every, sink_blocks + rolling)


def blocks_needed(num_tokens: int, layout: KVLayout, chunk_tokens: int = 1) -> int:
    """Blocks a sequence of `num_tokens` tokens must hold at once, over every group.

    Admission calls this with prompt + max_tokens; the planner with --context. A request
    is admissible iff this is <= the pool's num_blocks.
    """
    return sum(
        group_blocks_needed(num_tokens, layout.block_size, g.window_tokens, layout.sink_tokens,
                            chunk_tokens)
        for g in layout.groups
    )


def max_sequence_tokens(num_blocks: int, layout: KVLayout, chunk_tokens: int = 1,
                        limit: int = 1 << 40) -> int | None:
    """The longest sequence whose blocks fit `num_blocks`; None when no length is too long.

    Found by bisection over `blocks_needed` (monotone in the length), so it is the
    allocator's own answer, not a separate formula.
    """
    if blocks_needed(limit, layout, chunk_tokens) <= num_blocks:
        return None  # every group rolls: memory never bounds the length
    lo, hi = 0, limit  # blocks_needed(lo) fits, blocks_needed(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blocks_needed(mid, layout, chunk_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid
    return lo
