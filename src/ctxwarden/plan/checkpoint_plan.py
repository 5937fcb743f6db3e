"""Plan straight from a checkpoint on disk: weights from its headers, or estimated."""

from __future__ import annotations

from ctxwarden.spec.checkpoint import Checkpoint
from ctxwarden.plan.capacity import MemoryPlan, plan_memory, weights_bytes_estimate


def plan_checkpoint(ckpt: Checkpoint, memory_bytes: int, **kwargs) -> MemoryPlan:
    """`plan_memory` for a resolved checkpoint; keyword arguments pass through."""
    if ckpt.weights_bytes is not None:
        weights, source = ckpt.weights_bytes, f"{ckpt.format} header"
    else:
        weights, source = weights_bytes_estimate(ckpt.spec), "estimated from config"
    return plan_memory(ckpt.spec, memory_bytes=memory_bytes, weights_bytes=weights,
                       weights_source=source, model_name=ckpt.name, **kwargs)
