"""The memory plan: how many KV blocks a budget buys, and what they hold.

`plan_memory` is what `ctxwarden plan` prints and what the engine uses to size its pool:
budget - weights - activation reserve = KV bytes, divided into pages of `KVLayout.page_bytes`.
Every capacity figure (max_concurrency, max_context) is computed with `blocks_needed`, the
same function admission calls, so the planner and the runtime cannot disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ctxwarden.spec.dtypes import dtype_bytes
from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.plan.kv import (
    KVLayout,
    blocks_needed,
    cdiv,
    group_blocks_needed,
    kv_bytes_per_token,
    kv_layout,
    max_sequence_tokens,
)


@dataclass(frozen=True)
class LayerKindPlan:
    """The KV cost of one kind of layer (full, sliding with its window, MLA)."""

    kind: str
    num_layers: int
    window_tokens: int | None
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # at the plan's context, capped at the window
    kv_bytes_per_sequence_blocks: int  # after rounding to blocks


@dataclass(frozen=True)
class MemoryPlan:
    """Everything `ctxwarden plan --json` reports. Keys are stable (listed in README)."""

    model: str
    model_type: str
    kv_dtype: str
    block_size: int
    context_tokens: int
    model_window_tokens: int
    memory_bytes: int
    weights_bytes: int
    # "<mode> layout on these kernels; ..." (plan/weights.py) | "safetensors header" |
    # "gguf header" | "estimated from config"
    weights_source: str
    activation_reserve_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_blocks: int
    page_bytes: int
    num_kv_groups: int
    num_blocks: int
    kv_pool_bytes: int  # num_blocks * page_bytes: what the runner allocates
    max_tokens_in_pool: int
    max_concurrency: int
    max_context: int | None  # None: every layer rolls, memory never bounds the length
    max_batched_tokens: int
    layer_kinds: tuple[LayerKindPlan, ...]
    # Fields the config left out -> the value its family's transformers class gave them.
    defaulted: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_kinds"] = [asdict(k) for k in self.layer_kinds]
        return d


def plan_memory(spec: ModelSpec, *, memory_bytes: int, weights_bytes: int,
                weights_source: str, context_tokens: int | None = None, kv_dtype: str = "bf16",
                block_size: int = 16, activation_reserve_bytes: int | None = None,
                max_batched_tokens: int = 1, model_name: str = "",
                window_tokens: int | None = None, sink_tokens: int = 0) -> MemoryPlan:
    """Plan the KV pool for `spec` inside `memory_bytes` (weights and activations first)."""
    context = context_tokens or spec.max_position_embeddings
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    layout = kv_layout(spec, kv_dtype, block_size, window_tokens, sink_tokens)
    reserve = (default_activation_reserve(spec, max_batched_tokens)
               if activation_reserve_bytes is None else activation_reserve_bytes)
    kv_budget = max(memory_bytes - weights_bytes - reserve, 0)
    num_blocks = kv_budget // layout.page_bytes
    per_seq_blocks = blocks_needed(context, layout, max_batched_tokens)
    kinds = _layer_kind_plans(layout, context)
    return MemoryPlan(
        model=model_name or spec.source, model_type=spec.model_type, kv_dtype=kv_dtype,
        block_size=block_size, context_tokens=context,
        model_window_tokens=spec.max_position_embeddings, memory_bytes=memory_bytes,
        weights_bytes=weights_bytes, weights_source=weights_source,
        activation_reserve_bytes=reserve, kv_budget_bytes=kv_budget,
        kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
        kv_bytes_per_sequence=sum(k.kv_bytes_per_sequence for k in kinds),
        kv_bytes_per_sequence_blocks=per_seq_blocks * layout.page_bytes,
        page_bytes=layout.page_bytes, num_kv_groups=layout.num_groups, num_blocks=num_blocks,
        kv_pool_bytes=num_blocks * layout.page_bytes,
        max_tokens_in_pool=num_blocks * block_size // layout.num_groups,
        max_concurrency=num_blocks // per_seq_blocks if per_seq_blocks else 0,
        max_context=max_sequence_tokens(num_blocks, layout, max_batched_tokens),
        max_batched_tokens=max_batched_tokens, layer_kinds=kinds, defaulted=dict(spec.defaulted),
    )


def _layer_kind_plans(layout: KVLayout, context: int) -> tuple[LayerKindPlan, ...]:
    merged: dict[tuple[str, int | None], int] = {}
    for g in layout.groups:
        key = (g.kind, g.window_tokens)
        merged[key] = merged.get(key, 0) + g.num_layers
    plans = []
    for (kind, window), n_layers in merged.items():
        per_token = n_layers * layout.layer_bytes_per_token
        held = context if window is None else min(context, layout.sink_tokens + window)
        n_groups = n_layers // layout.layers_per_group
        blocks = n_groups * group_blocks_needed(context, layout.block_size, window, layout.sink_tokens)
        plans.append(LayerKindPlan(kind, n_layers, window, per_token, per_token * held,
                                   blocks * layout.page_bytes))
    return tuple(plans)


def default_activation_reserve(spec: ModelSpec, max_batched_tokens: int) -> int:
    """Working memory for one forward step, kept out of the KV budget.

    Sized for the largest transient tensors of a step of `max_batched_tokens` tokens in fp32:
    the MLP's gate/up activations, the attention scores of one head group over a chunk, and
    the logits of the sampled rows (one row per sequence, bounded by the batch). Plus a fixed
    256 MiB for the allocator's slack and the Python runtime.
    """
    tokens = max(max_batched_tokens, 1)
    mlp = 3 * tokens * spec.intermediate_size * 4
    hidden = 4 * tokens * spec.hidden_size * 4
    logits = min(tokens, 256) * spec.vocab_size * 4
    return mlp + hidden + logits + 256 * 1024**2


def process_plan(spec: ModelSpec, layout: KVLayout, *, weights_bytes: int, sequence_tokens: list[int],
                 max_batched_tokens: int) -> dict[str, int]:
    """What one serving process should hold at its peak while `sequence_tokens` (each
    sequence's prompt + output tokens) run at once: the weights (their runtime layout, see
    plan/weights.py), the KV blocks admission reserves for those sequences (the pool's pages
    are mapped as they are first written, so the rest of the pool is not resident), and the
    activation reserve, whose fixed part covers the Python runtime. `ctxwarden bench` holds
    each W2 child's peak RSS to this (issue 11: peak RSS <= the plan + 10%)."""
    kv = sum(blocks_needed(n, layout, max_batched_tokens) for n in sequence_tokens) * layout.page_bytes
    reserve = default_activation_reserve(spec, max_batched_tokens)
    return {"weights_bytes": weights_bytes, "kv_bytes": kv, "activation_reserve_bytes": reserve,
            "total_bytes": weights_bytes + kv + reserve}


def weights_bytes_estimate(spec: ModelSpec) -> int:
    """Parameter bytes from the architecture alone, at the config's dtype.

    Used only when no weight files are present (a bare config.json); the plan says so.
    """
    from ctxwarden.plan.params import count_parameters

    return count_parameters(spec) * dtype_bytes(spec.dtype)


def kv_bytes_at(spec: ModelSpec, layout: KVLayout, context: int) -> dict[str, int]:
    """KV bytes per layer kind for one sequence of `context` tokens (used by --plot)."""
    return {f"{k.kind}" + (f" (window {k.window_tokens})" if k.window_tokens else ""):
            k.kv_bytes_per_sequence for k in _layer_kind_plans(layout, context)}


__all__ = ["MemoryPlan", "LayerKindPlan", "plan_memory", "default_activation_reserve", "process_plan",
           "weights_bytes_estimate", "kv_bytes_at", "cdiv"]
