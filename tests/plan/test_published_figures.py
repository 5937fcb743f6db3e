"""KV figures of real model families against their published numbers."""

from pathlib import Path

import pytest

from ctxwarden.spec.checkpoint import resolve_checkpoint
from ctxwarden.spec.model_spec import FULL, SLIDING, load_model_config
from ctxwarden.plan import kv_bytes_per_token, kv_layout, plan_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
GiB = 1024**3


def spec(name):
    return load_model_config(CONFIGS / f"{name}.json")


@pytest.mark.parametrize(
    "name, per_token",
    [
        ("llama-3.1-8b", 131_072),  # 2 (K,V) x 8 kv heads x 128 x 32 layers x 2 B
        ("llama-3.1-8b-tf5", 131_072),
        ("qwen2.5-7b", 57_344),  # 4 kv heads x 128 x 28 layers
        ("qwen3-8b", 147_456),  # explicit head_dim 128, 36 layers
        ("mistral-7b-v0.1", 131_072),
        ("gemma-2-9b", 344_064),  # head_dim 256 (not 3584/16 = 224), 42 layers
        ("gemma-3-27b-it", 507_904),  # text_config: 16 kv heads x 128 x 62 layers
        ("gemma-3-27b-it-tf5", 507_904),
        ("deepseek-v3", 70_272),  # MLA: (512 + 64) x 61 layers x 2 B
        ("phi-3-mini-128k-instruct", 393_216),  # MHA: 32 kv heads x 96 x 32 layers
        ("smollm2-135m-instruct", 23_040),
    ],
)
def test_kv_bytes_per_token_bf16(name, per_token):
    assert kv_bytes_per_token(spec(name), "bf16") == per_token


def test_gemma2_sliding_layers_capped_at_window():
    ckpt = resolve_checkpoint(CONFIGS / "gemma-2-9b.json")
    plan = plan_checkpoint(ckpt, 80 * GiB, context_tokens=32_768, kv_dtype="bf16")
    # 21 global layers hold 32K tokens, 21 local layers hold their 4,096-token window.
    assert plan.kv_bytes_per_sequence == 21 * 8192 * (32_768 + 4096)
    assert 5.85 < plan.kv_bytes_per_sequence / GiB < 5.95  # "about 5.9 GiB"
    charged_in_full = kv_bytes_per_token(ckpt.spec, "bf16") * 32_768
    assert round(charged_in_full / GiB, 1) == 10.5  # what a window-blind calculator says
    kinds = {k.kind: k for k in plan.layer_kinds}
    assert kinds["sliding"].num_layers == kinds["full"].num_layers == 21
    assert kinds["sliding"].window_tokens == 4096


def test_gemma3_five_local_to_one_global_both_config_forms():
    a, b = spec("gemma-3-27b-it"), spec("gemma-3-27b-it-tf5")
    assert a.layer_types == b.layer_types
    assert a.layer_types.count(FULL) == 10 and a.layer_types.count(SLIDING) == 52
    assert a.layer_types[5] == FULL and a.layer_types[0] == SLIDING
    assert a.rope.rope_type == b.rope.rope_type == "linear" and a.rope.theta == b.rope.theta == 1e6
    assert a.rope_local.theta == b.rope_local.theta == 10_000.0
    plan = plan_checkpoint(resolve_checkpoint(CONFIGS / "gemma-3-27b-it.json"), 200 * GiB,
                           context_tokens=131_072)
    assert plan.kv_bytes_per_sequence == 8192 * (10 * 131_072 + 52 * 1024)


def test_transformers_4_and_5_configs_parse_to_the_same_spec():
    a, b = spec("llama-3.1-8b"), spec("llama-3.1-8b-tf5")
    assert a.rope == b.rope and a.rope.rope_type == "llama3" and a.rope.params["factor"] == 8.0
    assert a.layer_types == b.layer_types and a.dtype == b.dtype == "bfloat16"


def test_mistral_slides_everywhere_and_memory_never_bounds_length():
    s = spec("mistral-7b-v0.1")
    assert s.layer_types == (SLIDING,) * 32 and s.window_tokens == 4096
    plan = plan_checkpoint(resolve_checkpoint(CONFIGS / "mistral-7b-v0.1.json"), 24 * GiB,
                           context_tokens=32_768)
    assert plan.kv_bytes_per_sequence == 4096 * 131_072  # 512 MiB, not 4 GiB
    assert plan.max_context is None


def test_qwen2_sliding_window_off_unless_enabled():
    s = spec("qwen2.5-7b")
    assert s.sliding_window is None and SLIDING not in s.layer_types


def test_deepseek_v3_is_mla_with_yarn():
    s = spec("deepseek-v3")
    assert s.is_mla and s.mla.cache_dim == 576
    assert s.rope.rope_type == "yarn" and s.rope.params["factor"] == 40


def test_phi3_partial_window_and_longrope():
    s = spec("phi-3-mini-128k-instruct")
    assert s.head_dim == 96 and s.rope.rope_type == "longrope"
    plan = plan_checkpoint(resolve_checkpoint(CONFIGS / "phi-3-mini-128k-instruct.json"),
                           80 * GiB, context_tokens=131_072)
    assert plan.kv_bytes_per_sequence == 393_216 * 131_072  # window 262,144 > context


def test_fp8_halves_bf16_plus_one_scale_byte_per_row():
    """Published fp8 figures (one scale per tensor) are exactly half of bf16; ours store a
    scale byte with each head's row: 32 layers x 8 KV heads x (K, V) = 512 bytes more."""
    s = spec("llama-3.1-8b")
    assert kv_bytes_per_token(s, "bf16") == 131_072
    assert kv_bytes_per_token(s, "fp8") == kv_bytes_per_token(s, "fp8_e5m2") == 65_536 + 512
    assert kv_bytes_per_token(s, "fp32") == 2 * kv_bytes_per_token(s, "bf16")


def test_layout_groups_have_equal_page_size():
    layout = kv_layout(spec("gemma-3-27b-it"), "bf16", 16)
    assert layout.layers_per_group == 2  # gcd(52, 10)
    assert layout.num_groups == 31
    assert layout.page_bytes == 16 * 2 * 8192
