"""Plan straight from a checkpoint on disk: weights from its headers, or estimated."""

from __future__ import annotations

from ctxwarden.spec.checkpoint import Checkpoint, read_safetensors_header
from ctxwarden.spec.gguf_header import read_gguf_header
from ctxwarden.plan.capacity import MemoryPlan, plan_memory, weights_bytes_estimate
from ctxwarden.plan.weights import KernelCaps, gguf_tensors, runtime_weights_bytes, safetensors_tensors


def planned_weights(ckpt: Checkpoint, weights: str | None = None, dtype: str = "float32",
                    caps: KernelCaps | None = None) -> tuple[int, str]:
    """(bytes, where they come from) of the checkpoint's weights: in the runtime layout of
    weights mode `weights` with compute `dtype` on kernels `caps` where that is modeled
    (plan/weights.py), else the bytes its headers store, else an estimate from the config."""
    if ckpt.weights_bytes is None:
        return weights_bytes_estimate(ckpt.spec), "estimated from config"
    stored = f"{ckpt.format} header"
    if weights is None or caps is None:
        return ckpt.weights_bytes, stored
    if ckpt.format == "gguf":
        tensors = gguf_tensors(read_gguf_header(ckpt.weight_files[0]))
    else:
        tensors = safetensors_tensors([read_safetensors_header(f) for f in ckpt.weight_files])
    spec = ckpt.spec
    held = runtime_weights_bytes(tensors, model_type=spec.model_type, tied=spec.tie_word_embeddings,
                                 mode=weights, dtype=dtype, caps=caps)
    if held is None:
        return ckpt.weights_bytes, f"{stored} (the {spec.model_type} runtime layout is not modeled)"
    return held, f"{weights} layout on these kernels; the {stored} stores {ckpt.weights_bytes / 1024**2:,.1f} MiB"


def plan_checkpoint(ckpt: Checkpoint, memory_bytes: int, *, weights: str | None = None,
                    dtype: str = "float32", caps: KernelCaps | None = None, **kwargs) -> MemoryPlan:
    """`plan_memory` for a resolved checkpoint, its weights counted by `planned_weights`;
    other keyword arguments pass through."""
    held, source = planned_weights(ckpt, weights, dtype, caps)
    return plan_memory(ckpt.spec, memory_bytes=memory_bytes, weights_bytes=held,
                       weights_source=source, model_name=ckpt.name, **kwargs)
