"""ModelRunner: a loaded model, its paged KV pool, and `forward(batch) -> logits`.

Algorithm of one step: build StepInputs from the ForwardBatch (slot mappings and key
gathers per KV group), run the model layer by layer (each layer writes its new K/V into the
pool, then attends through the block tables), and return fp32 logits for the rows asked
for only. The runner owns no scheduling state: which blocks a sequence holds is the block
manager's business, handed in through the block tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ctxwarden.diagnostics.leaks import malloc_trim
from ctxwarden.spec.checkpoint import Checkpoint, resolve_checkpoint
from ctxwarden.plan.kv import KVLayout, kv_layout
from ctxwarden.runner.attention import AttentionBackend, TorchPagedAttention
from ctxwarden.runner.host_malloc import tune_malloc
from ctxwarden.runner.inputs import ForwardBatch, build_step_inputs
from ctxwarden.runner.kv_cache import PagedKVCache

_BACKENDS = {"torch": TorchPagedAttention}


@dataclass(frozen=True)
class RunnerConfig:
    """How to run a model: pool size, page size, dtypes, window mode, attention backend."""

    num_blocks: int
    block_size: int = 16
    kv_dtype: str = "fp32"
    dtype: str = "float32"  # weights and activations
    window_tokens: int | None = None  # sink mode: rolling window after the sinks
    sink_tokens: int = 0
    attention_backend: str = "torch"
    weights: str = "fp32"  # models.loader.WEIGHTS_MODES: how projections are stored
    # Prompt rows' attention: "bf16" dot products (AVX-512 BF16 builds; generated rows stay
    # fp32), "fp32", or "auto": bf16 where the KV cache is bf16 and the build can.
    prompt_attention: str = "auto"

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of "
                             f"{sorted(_BACKENDS)}")
        from ctxwarden.engine.config import PROMPT_ATTENTION_MODES, WEIGHTS_MODES

        if self.weights not in WEIGHTS_MODES:
            raise ValueError(f"weights must be one of {WEIGHTS_MODES}, got {self.weights!r}")
        if self.sink_tokens and not self.window_tokens:
            raise ValueError("sink_tokens needs window_tokens (the rolling window after the sinks)")
        if self.prompt_attention not in PROMPT_ATTENTION_MODES:
            raise ValueError(f"prompt_attention must be one of {', '.join(PROMPT_ATTENTION_MODES)}, "
                             f"got {self.prompt_attention!r}")


# oneDNN primitives cached per process (its default is 1,024). An entry can hold a
# reordered copy of its weight, and a quantized weight expanded for one prefill GEMM is a
# new tensor every call: with 256 entries a server grew ~1.3 MB per request of a new
# length even with bucketed shapes; with 16 it stays flat (tests/server/
# test_memory_growth.py). 16 still holds a decode step's 5 weight shapes, so steady decode
# never rebuilds a primitive; a prefill GEMM of >= 64 rows dwarfs a rebuild.
PRIMITIVE_CACHE_CAPACITY = 16


def bound_primitive_cache() -> None:
    """Cap oneDNN's primitive cache unless the operator set it; oneDNN reads the variable
    when it creates its cache, i.e. at the first oneDNN primitive of the process."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))
    # ideep (torch's oneDNN wrapper) keeps an LRU of its own, 1,024 entries by default
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def _allocate_kv(spec, layout: KVLayout, config: RunnerConfig) -> PagedKVCache:
    """The pool of `config.num_blocks` pages; MLA caches one row [latent | rope key] per token."""
    if spec.mla is not None:
        if str(config.kv_dtype).startswith("fp8"):
            raise ValueError(f"kv_dtype {config.kv_dtype!r} is not supported for MLA models ({spec.model_type}: "
                             "the latent row is read in place); use kv_dtype 'auto', 'bf16' or 'fp32'")
        return PagedKVCache(layout, config.num_blocks, 1, spec.mla.cache_dim, config.kv_dtype,
                            values_share_keys=True)
    return PagedKVCache(layout, config.num_blocks, spec.num_kv_heads, spec.head_dim, config.kv_dtype)


def resolve_prompt_attention(config: RunnerConfig, spec) -> str:
    """"bf16" or "fp32": what prompt rows take (RunnerConfig.prompt_attention). bf16 needs an
    AVX-512 BF16 build of ext/, fp32 activations, head_dim a multiple of 16 and a model
    whose layers attend through the paged backend's flash kernel (not MLA, no logit
    soft-capping); "auto" also needs a bf16 KV cache (whose K and V are then read as they
    are stored) and bf16 measured faster than fp32 here (prompt_attention_speed)."""
    from ctxwarden.ext import kernels

    if config.prompt_attention == "fp32":
        return "fp32"
    ext = kernels()
    able = (ext is not None and getattr(ext, "has_bf16_attention", lambda: False)()
            and config.dtype in ("fp32", "float32") and spec.mla is None and spec.head_dim % 16 == 0
            and spec.head_dim <= 512 and spec.attn_logit_softcapping is None)
    if config.prompt_attention == "bf16":
        if not able:
            raise ValueError("prompt_attention='bf16' needs ext/ kernels built for AVX-512 BF16 (this build: "
                             f"{'none' if ext is None else ext.simd_level()}), dtype fp32 (got {config.dtype}), "
                             f"head_dim a multiple of 16 up to 512 (got {spec.head_dim}), no MLA and no "
                             "attention soft-capping; "
                             "use prompt_attention='fp32' or 'auto'")
        return "bf16"
    if not (able and config.kv_dtype == "bf16"):
        return "fp32"
    return prompt_attention_speed(spec.head_dim)[0]


@lru_cache(maxsize=None)
def prompt_attention_speed(head_dim: int) -> tuple[str, float]:
    """('bf16' | 'fp32', bf16 dots' speed over fp32 as measured): which prompt attention
    "auto" takes on this CPU, by timing ext's flash kernel both ways.

    bf16 dot products are not faster everywhere: on a Zen 4 (vdpbf16ps at twice an FMA's
    multiply-adds) they ran 1.61-1.84x fp32, on an Intel Xeon with AMX whose tiles were not
    used 0.73x (its two FMA ports against one for vdpbf16ps), and on its tile units 2.5-3.6x
    (kernel_ab.py, 2026-12-07). So "auto" measures: 192 causal queries over 768 keys, 6
    query heads on 2 KV heads of `head_dim`, bf16 K/V, interleaved, 5 rounds of 2 calls
    after a warm-up (~10-40 ms, once per process and head size), and takes bf16 only when
    its median is under 0.9x fp32's, as fp32_gemm_backend does (layers/linear.py speedup).
    $CTXWARDEN_PROMPT_ATTENTION=bf16|fp32 (EngineConfig) decides without measuring.
    """
    from ctxwarden.ext import kernels
    from ctxwarden.layers.linear import speedup

    ext = kernels()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(192, 6, head_dim, generator=g)
    k, v = (torch.randn(768, 2, head_dim, generator=g).bfloat16() for _ in range(2))
    kf, vf = k.float(), v.float()
    scale = head_dim ** -0.5

    def bf16():
        return ext.prefill_attention(q, k, v, 768 - 192, 0, 0, scale, None, 0, True)

    def fp32():
        return ext.prefill_attention(q, kf, vf, 768 - 192, 0, 0, scale, None, 0, False)

    ratio = speedup(fp32, bf16)
    return ("bf16" if ratio > 1 / 0.9 else "fp32"), ratio


class ModelRunner:
    """Runs one model over a paged KV cache of `config.num_blocks` pages."""

    def __init__(self, model: str | Path | Checkpoint | None, config: RunnerConfig):
        from ctxwarden.models.loader import load_model

        bound_primitive_cache()
        tune_malloc()
        self.checkpoint = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
        self.config = config
        self.spec = self.checkpoint.spec
        self.layout: KVLayout = kv_layout(self.spec, config.kv_dtype, config.block_size,
                                          config.window_tokens, config.sink_tokens)
        self.model = load_model(self.checkpoint, config.dtype, config.weights)
        self.kv_cache = _allocate_kv(self.spec, self.layout, config)
        self.prompt_attention = resolve_prompt_attention(config, self.spec)
        self.backend: AttentionBackend = _BACKENDS[config.attention_backend](
            prompt_bf16=self.prompt_attention == "bf16")
        # the load's temporaries (GGUF blocks copied out, stacked parts, panels' sources, the
        # kernel timings) are freed by now, but tune_malloc's trim threshold keeps them in the
        # heap: hand them back, so RSS after load is the weights and the runtime (plan/weights.py)
        malloc_trim()

    @property
    def prompt_rows_apart(self) -> bool:
        """Whether prompt and generated rows attend at different precisions: a prefix-cache
        block holding generated tokens then holds KV that the same tokens as a prompt would
        not make, and must not be shared (Scheduler.prompt_blocks_only)."""
        return self.prompt_attention != "fp32"

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; logits [batch.num_logits_rows, vocab] fp32, sequences in order."""
        step = build_step_inputs(batch, self.layout, self.config.num_blocks, self.prompt_rows_apart)
        hidden = self.model.forward(step, self.kv_cache, self.backend)
        return self.model.compute_logits(hidden)
