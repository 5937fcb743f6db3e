"""EngineConfig: every knob of the engine, validated once, frozen (no torch).

This is the one place engine defaults live. `LLM(...)`, `ctxwarden generate` and
`ctxwarden serve` all build an EngineConfig (the CLI's flags and their defaults are read
off these fields by `ctxwarden.cli._engine_args`), and the server's config holds one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ctxwarden.kv.tiers.config import TiersConfig, parse_tiers
from ctxwarden.spec.rope_scaling import parse_rope_scaling
from ctxwarden.spec.dtypes import ACTIVATION_DTYPES, canonical_dtype
from ctxwarden.units import parse_bytes

PREEMPTION_MODES = ("auto", "recompute", "swap")
TIER_FETCH_POLICIES = ("auto", "always")  # auto: the cost model; always: fetch whatever is found
SERVER_MAX_WAITING = 256  # a server bounds its queue (429 past it); offline runs do not
SERVER_MAX_QUEUE_DELAY_S = 120.0  # a server refuses what would wait longer; offline runs wait
# What the torch runner can store (fp8: float8 codes + a scale byte per row, runner/kv_quant.py).
RUNNER_KV_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
# How projections are stored (models/loader.py): auto keeps a GGUF's Q4_x / Q8_0 codes
# (exact fp32-activation kernels), fp32 / bf16 dense, int8 / int4 quantize every projection.
# auto-int8act stores what auto stores and multiplies the quantized codes with activations
# rounded to int8 per group of 32 (integer dot products, llama.cpp's method; at every step
# size, so a row's result never depends on its batch).
WEIGHTS_MODES = ("auto", "fp32", "bf16", "int8", "int4", "auto-int8act")
PROMPT_ATTENTION_MODES = ("auto", "bf16", "fp32")  # runner.model_runner.resolve_prompt_attention


def resolve_weights_mode(weights: str | None) -> str:
    """The weights mode asked for, else $CTXWARDEN_WEIGHTS, else auto (what serve and the
    planner both take; validated by EngineConfig)."""
    return weights or os.environ.get("CTXWARDEN_WEIGHTS") or "auto"


@dataclass(frozen=True)
class EngineConfig:
    """How to run one model. `kv_memory_bytes` is the KV pool alone (weights not counted).

    Dtypes may be given in either vocabulary (`bfloat16` or `bf16`) and are stored as the
    canonical short name; `kv_dtype=None` means "the same as `dtype`".
    """

    model: str | None = None  # HF dir, .gguf, or None for SmolLM2-135M-Instruct
    kv_memory_bytes: int = 2 * 1024**3
    block_size: int = 16
    dtype: str = "fp32"  # weights and activations
    kv_dtype: str | None = None  # None: the same as dtype
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_waiting: int | None = None  # None: unbounded (offline); the server bounds it
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # sliding-window layouts always recompute
    swap_space_bytes: int = 4 * 1024**3
    window_tokens: int | None = None  # sink (streaming) mode: the rolling window
    sink_tokens: int = 0  # sink mode: tokens kept at the start
    max_queue_delay_s: float | None = None  # refuse requests predicted to wait longer (429)
    contended_prefill_tokens: int | None = None  # None: about one decode step's worth, measured
    kv_tiers: TiersConfig | str | None = None  # 'ram:4GiB,disk:/path:20GiB,redis://host:6379'
    kv_tier_fetch: str = "auto"  # auto: fetch only where the cost model says it beats recompute
    weights: str | None = None  # WEIGHTS_MODES; None: $CTXWARDEN_WEIGHTS, else auto
    # transformers' rope_scaling / rope_parameters dict (or its JSON): replaces the file's RoPE
    rope_scaling: dict | str | None = None
    allow_long_max_model_len: bool = False  # max_model_len past the model's window, unscaled
    attention_sample_rate: float = 0.0  # share of requests whose attention is monitored (0: off)
    # prompt rows' attention: auto (bf16 dot products with a bf16 KV cache on AVX-512 BF16), bf16,
    # fp32; None: $CTXWARDEN_PROMPT_ATTENTION, else auto
    prompt_attention: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, ACTIVATION_DTYPES))
        kv = self.dtype if self.kv_dtype is None else self.kv_dtype
        object.__setattr__(self, "kv_dtype", canonical_dtype(kv, RUNNER_KV_DTYPES, "kv_dtype"))
        # the variable lets a whole test run (or a deployment) pick the mode without code
        weights = resolve_weights_mode(self.weights)
        if weights not in WEIGHTS_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
        object.__setattr__(self, "weights", weights)
        for name in ("kv_memory_bytes", "block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "window_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.max_queue_delay_s is not None and not self.max_queue_delay_s > 0:
            raise ValueError(f"max_queue_delay_s must be > 0 (or None: no limit), got {self.max_queue_delay_s}")
        if self.contended_prefill_tokens is not None and self.contended_prefill_tokens < 1:
            raise ValueError(f"contended_prefill_tokens must be >= 1, got {self.contended_prefill_tokens}")
        object.__setattr__(self, "prompt_attention",
                           self.prompt_attention or os.environ.get("CTXWARDEN_PROMPT_ATTENTION") or "auto")
        if self.prompt_attention not in PROMPT_ATTENTION_MODES:
            raise ValueError(f"prompt_attention must be one of {', '.join(PROMPT_ATTENTION_MODES)}, "
                             f"got {self.prompt_attention!r}")
        if not 0.0 <= self.attention_sample_rate <= 1.0:
            raise ValueError(f"attention_sample_rate must be in [0, 1] (a share of requests), got "
                             f"{self.attention_sample_rate}")
        if self.swap_space_bytes < 0 or self.sink_tokens < 0:
            raise ValueError("swap_space_bytes and sink_tokens must be >= 0")
        if self.sink_tokens and not self.window_tokens:
            raise ValueError("sink_tokens needs window_tokens (the rolling window after the sinks)")
        self._check_tiers()

    def _check_tiers(self) -> None:
        tiers = self.kv_tiers if isinstance(self.kv_tiers, TiersConfig) else parse_tiers(self.kv_tiers)
        object.__setattr__(self, "kv_tiers", tiers)
        if tiers.is_enabled and not self.enable_prefix_caching:
            raise ValueError("kv_tiers extend the prefix cache; they need enable_prefix_caching=True "
                             "(drop --no-prefix-caching or --kv-tiers)")
        if self.kv_tier_fetch not in TIER_FETCH_POLICIES:
            raise ValueError(f"kv_tier_fetch must be one of {', '.join(TIER_FETCH_POLICIES)}, "
                             f"got {self.kv_tier_fetch!r}")
        if tiers.is_enabled and self.is_unbounded_length:
            raise ValueError("kv_tiers do not support sink / rolling-window mode (window_tokens); "
                             "drop --kv-tiers or --window-tokens")

    @property
    def is_unbounded_length(self) -> bool:
        """Sink / rolling-window mode: sequences stream past the model's window."""
        return bool(self.sink_tokens or self.window_tokens)

    @classmethod
    def build(cls, kv_memory: int | str | None = None, swap_space: int | str | None = None,
              **kwargs) -> "EngineConfig":
        """Like the constructor, but byte sizes may be strings with units ('2GiB')."""
        if kv_memory is not None:
            kwargs["kv_memory_bytes"] = parse_bytes(kv_memory)
        if swap_space is not None:
            kwargs["swap_space_bytes"] = parse_bytes(swap_space)
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; "
                            f"the options are {', '.join(f.name for f in fields(cls))}")
        return cls(**kwargs)
