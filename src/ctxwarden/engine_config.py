"""EngineConfig: every knob of the engine, validated once, frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ctxwarden.config import parse_bytes

_DTYPES = ("float32", "bfloat16", "float16")
_KV_DTYPES = ("fp32", "bf16", "fp16")
WEIGHTS_MODES = ("auto", "fp32", "bf16", "int8", "int4")  # the same tuple as models.loader's


def _default_weights() -> str:
    # CTXWARDEN_WEIGHTS lets a whole test run (or a deployment) pick the mode without code
    return os.environ.get("CTXWARDEN_WEIGHTS", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """How to run one model. `kv_memory_bytes` is the KV pool alone (weights not counted)."""

    model: str | None = None  # HF dir, .gguf, or None for SmolLM2-135M-Instruct
    kv_memory_bytes: int = 2 * 1024**3
    block_size: int = 16
    dtype: str = "float32"
    kv_dtype: str = "fp32"
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_waiting: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # auto | swap | recompute (sliding-window layouts: recompute)
    swap_space_bytes: int = 4 * 1024**3
    window_tokens: int | None = None  # sink mode: the rolling window
    sink_tokens: int = 0  # sink mode: tokens kept at the start
    # how projections are stored: auto keeps a GGUF's Q4_x / Q8_0 quantized (exact
    # fp32 kernels), fp32 / bf16 dense, int8 / int4 quantize every projection
    weights: str = field(default_factory=_default_weights)

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS_MODES:
            raise ValueError(f"weights must be one of {WEIGHTS_MODES}, got {self.weights!r}")
        if self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {_KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("kv_memory_bytes", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.sink_tokens and not self.window_tokens:
            raise ValueError("sink_tokens needs window_tokens (the rolling window after the sinks)")

    @classmethod
    def build(cls, kv_memory: int | str = "2GiB", swap_space: int | str = "4GiB", **kwargs) -> "EngineConfig":
        """Like the constructor, but byte sizes may be strings with units ('2GiB')."""
        return cls(kv_memory_bytes=parse_bytes(kv_memory), swap_space_bytes=parse_bytes(swap_space), **kwargs)
