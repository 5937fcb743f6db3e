"""The engine's flags, shared by `generate` and `serve`: one flag per EngineConfig field.

Defaults are read off EngineConfig itself (never restated here); a command may override a
default where its use differs (the server bounds its queue, an offline run does not).
Imports no torch: the parser is built before any command decides to load a model.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from ctxwarden.engine.config import (PREEMPTION_MODES, PROMPT_ATTENTION_MODES, RUNNER_KV_DTYPES,
                                     TIER_FETCH_POLICIES, WEIGHTS_MODES, EngineConfig)
from ctxwarden.spec.dtypes import ACTIVATION_DTYPES

# field -> (flag, help). Byte sizes take units; the flag name drops the `_bytes` suffix.
_FLAGS = {
    "model": ("--model", "HF model directory or .gguf (default: SmolLM2-135M-Instruct)"),
    "kv_memory_bytes": ("--kv-memory", "KV pool size per model, e.g. 2GiB (weights not counted)"),
    "block_size": ("--block-size", "tokens per KV block (page)"),
    "dtype": ("--dtype", "weights and activations: fp32 / float32, bf16 / bfloat16, fp16"),
    "kv_dtype": ("--kv-dtype", "KV cache dtype (default: the same as --dtype)"),
    "max_num_seqs": ("--max-num-seqs", "sequences running at once"),
    "max_batched_tokens": ("--max-batched-tokens", "tokens per engine step (the prefill chunk)"),
    "max_waiting": ("--max-waiting", "waiting-queue bound; past it requests are refused (429)"),
    "max_model_len": ("--max-model-len", "context window admitted against (default: the model's)"),
    "enable_prefix_caching": ("--prefix-caching", "reuse KV of shared prompt prefixes, per tenant"),
    "preemption_mode": ("--preemption-mode", "under KV pressure: auto (by cost), swap, recompute"),
    "swap_space_bytes": ("--swap-space", "host memory for swapped-out KV, e.g. 4GiB"),
    "window_tokens": ("--window-tokens", "sink (streaming) mode: the rolling attention window"),
    "sink_tokens": ("--sink-tokens", "sink mode: tokens kept at the start (needs --window-tokens)"),
    "max_queue_delay_s": ("--max-queue-delay", "seconds: refuse (429 + Retry-After) a request whose "
                          "predicted time to first token is longer"),
    "weights": ("--weights", "how projections are stored: auto (a GGUF's Q4_x/Q8_0 kept quantized), "
                "fp32, bf16, int8, int4 (default: $CTXWARDEN_WEIGHTS or auto)"),
    "contended_prefill_tokens": ("--contended-prefill-tokens", "prefill tokens per step of a tenant "
                                 "while a less-served tenant decodes (default: one decode step's worth)"),
    "kv_tiers": ("--kv-tiers", "KV tiers beyond the pool, e.g. ram:4GiB,disk:/path:20GiB,redis://127.0.0.1:6379 "
                 "(off unless named; see docs/kv-tiers.md)"),
    "rope_scaling": ("--rope-scaling", "RoPE scaling as transformers' rope_scaling JSON, e.g. "
                     "'{\"rope_type\": \"yarn\", \"factor\": 4}' (linear, dynamic, yarn, longrope, llama3); "
                     "the window becomes trained x factor"),
    "allow_long_max_model_len": ("--allow-long-max-model-len", "allow --max-model-len past the model's window "
                                 "without RoPE scaling (every response then says so in a header)"),
    "kv_tier_fetch": ("--kv-tier-fetch", "auto: fetch from a tier only where the cost model says it beats "
                      "recomputing; always: fetch whatever a tier holds"),
    "attention_sample_rate": ("--attention-sample-rate", "share of requests whose attention is monitored "
                              "(entropy, sink mass; GET /debug/attention/ID); 0 = off"),
    "prompt_attention": ("--prompt-attention", "prompt rows' attention: auto (bf16 dot products where the KV "
                         "cache is bf16 and the CPU has AVX512-BF16), bf16, fp32; generated rows stay fp32"),
}
_FLOATS = ("max_queue_delay_s", "attention_sample_rate")
_TEXT_FIELDS = {"model": "MODEL", "kv_tiers": "TIERS", "rope_scaling": "JSON"}  # free text, not a number
_CHOICES = {"dtype": ACTIVATION_DTYPES + ("float32", "bfloat16", "float16"),
            "kv_dtype": RUNNER_KV_DTYPES + ("float32", "bfloat16", "float16", "fp8", "float8_e4m3fn",
                                         "float8_e5m2"),
            "preemption_mode": PREEMPTION_MODES, "kv_tier_fetch": TIER_FETCH_POLICIES, "weights": WEIGHTS_MODES,
            "prompt_attention": PROMPT_ATTENTION_MODES}


def add_engine_arguments(p: argparse.ArgumentParser, **default_overrides) -> None:
    """Add one flag per EngineConfig field, defaults from EngineConfig unless overridden."""
    group = p.add_argument_group("engine")
    unknown = set(default_overrides) - {f.name for f in fields(EngineConfig)}
    if unknown:
        raise ValueError(f"no engine option named {', '.join(sorted(unknown))}")
    for f in fields(EngineConfig):
        flag, help_text = _FLAGS[f.name]
        default = default_overrides.get(f.name, f.default if f.default is not MISSING else None)
        kwargs = {"dest": f"engine_{f.name}", "default": default}
        if f.name.endswith("_bytes"):
            kwargs.update(type=str, default=_human_bytes(default), metavar="SIZE")
        elif isinstance(default, bool):
            kwargs.update(action=argparse.BooleanOptionalAction)  # it states its default
        elif f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        elif f.name in _FLOATS:
            kwargs.update(type=float, metavar="S")
        elif f.name not in _TEXT_FIELDS:
            kwargs.update(type=int, metavar="N")
        else:
            kwargs["metavar"] = _TEXT_FIELDS[f.name]
        if kwargs["default"] is not None and not isinstance(default, bool):
            help_text += f" (default: {kwargs['default']})"
        group.add_argument(flag, help=help_text, **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe (validated by EngineConfig itself)."""
    values = {f.name: getattr(args, f"engine_{f.name}") for f in fields(EngineConfig)}
    return EngineConfig.build(kv_memory=values.pop("kv_memory_bytes"),
                              swap_space=values.pop("swap_space_bytes"), **values)


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
