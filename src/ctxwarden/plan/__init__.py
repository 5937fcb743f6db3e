"""Memory planning: pure arithmetic over a ModelSpec and a byte budget (no torch).

The planner CLI, admission and the block manager all import from here, so the numbers they
use are the same numbers:

- `kv`: bytes per token, layer groups (`kv_layout`), `blocks_needed`, `max_sequence_tokens`.
- `capacity`: `plan_memory` -> `MemoryPlan` (num_blocks, max_concurrency, max_context, ...).
- `params`, `train`: parameter counts and the training-memory estimate.
"""

from ctxwarden.plan.capacity import LayerKindPlan, MemoryPlan, plan_memory
from ctxwarden.plan.checkpoint_plan import plan_checkpoint
from ctxwarden.plan.kv import (
    KVGroup,
    KVLayout,
    blocks_needed,
    cdiv,
    group_blocks_needed,
    kv_bytes_per_token,
    kv_dtype_bytes,
    kv_layout,
    layer_kv_bytes_per_token,
    max_sequence_tokens,
)


__all__ = [
    "KVGroup", "KVLayout", "LayerKindPlan", "MemoryPlan", "blocks_needed", "cdiv",
    "group_blocks_needed", "kv_bytes_per_token", "kv_dtype_bytes", "kv_layout",
    "layer_kv_bytes_per_token", "max_sequence_tokens", "plan_memory", "plan_checkpoint",
]
