"""Capacity arithmetic: the planner's figures are the allocator's block arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from ctxwarden.spec.checkpoint import default_model_path, resolve_checkpoint
from ctxwarden.spec.model_spec import load_model_config, parse_model_config
from ctxwarden.units import parse_bytes
from ctxwarden.errors import ConfigError, ModelNotFound
from ctxwarden.plan import blocks_needed, group_blocks_needed, kv_layout, plan_memory
from ctxwarden.plan.train import plan_training

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
GiB = 1024**3


def _plan(name, memory=24 * GiB, **kw):
    spec = load_model_config(CONFIGS / f"{name}.json")
    return spec, plan_memory(spec, memory_bytes=memory, weights_bytes=2 * GiB,
                             weights_source="test", activation_reserve_bytes=GiB, **kw)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gemma-2-9b", "gemma-3-27b-it", "deepseek-v3"])
def test_max_context_is_the_allocators_edge(name):
    spec, plan = _plan(name, context_tokens=8192)
    layout = kv_layout(spec, "bf16", 16)
    assert plan.num_blocks == (24 * GiB - 3 * GiB) // layout.page_bytes
    assert plan.kv_pool_bytes == plan.num_blocks * layout.page_bytes <= plan.kv_budget_bytes
    edge = plan.max_context
    assert blocks_needed(edge, layout, plan.max_batched_tokens) <= plan.num_blocks
    assert blocks_needed(edge + 1, layout, plan.max_batched_tokens) > plan.num_blocks


def test_max_concurrency_counts_whole_sequences():
    spec, plan = _plan("llama-3.1-8b", context_tokens=32_768)
    per_seq = 32_768 // 16
    assert plan.max_concurrency == plan.num_blocks // per_seq
    assert plan.kv_bytes_per_sequence_blocks == per_seq * plan.page_bytes


def test_block_rounding_charges_partial_blocks():
    spec, plan = _plan("smollm2-135m-instruct", context_tokens=1000)
    assert plan.kv_bytes_per_sequence == 1000 * 23_040
    assert plan.kv_bytes_per_sequence_blocks == 63 * 16 * 23_040  # ceil(1000 / 16) = 63


@given(tokens=st.integers(1, 400), window=st.integers(1, 120), block=st.sampled_from([1, 4, 16]),
       chunk=st.integers(1, 50), sink=st.integers(0, 20))
@settings(max_examples=300, deadline=None)
def test_window_blocks_cover_every_step(tokens, window, block, chunk, sink):
    """A rolling group's block count covers the blocks any step touches, and is tight.

    A step writing positions [p, p + chunk) reads the sinks plus [p - window + 1, p + chunk):
    count the distinct blocks of that, by brute force over every p.
    """
    need = group_blocks_needed(tokens, block, window, sink, chunk)
    worst = 0
    for p in range(tokens):
        end = min(p + chunk, tokens)
        touched = {i // block for i in range(min(sink, end))}
        touched |= {i // block for i in range(max(0, p - window + 1), end)}
        worst = max(worst, len(touched))
    assert worst <= need <= -(-tokens // block)
    assert need - worst <= 1 + -(-sink // block)  # never more than one spare block per run


def test_sink_mode_length_is_unbounded():
    spec, plan = _plan("smollm2-135m-instruct", context_tokens=100_000, window_tokens=4096,
                       sink_tokens=4)
    assert plan.max_context is None
    assert plan.kv_bytes_per_sequence == (4096 + 4) * 23_040


def test_weights_bytes_come_from_safetensors_headers(tmp_path):
    cfg = json.loads((CONFIGS / "smollm2-135m-instruct.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = {"x": np.zeros((7, 3), np.float32), "y": np.zeros(5, np.float16)}
    b = {"z": np.zeros((2, 2, 2), np.int8)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    ckpt = resolve_checkpoint(tmp_path)
    assert ckpt.format == "safetensors"
    assert ckpt.weights_bytes == 7 * 3 * 4 + 5 * 2 + 8


def test_default_gguf_reads_the_same_spec_as_the_published_config():
    ckpt = resolve_checkpoint(None)
    published = load_model_config(CONFIGS / "smollm2-135m-instruct.json")
    assert ckpt.path == default_model_path() and ckpt.format == "gguf"
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings",
                  "tie_word_embeddings", "layer_types"):
        assert getattr(ckpt.spec, field) == getattr(published, field), field
    assert ckpt.spec.rope.theta == published.rope.theta
    assert ckpt.weights_bytes == default_model_path().stat().st_size - _gguf_overhead(ckpt)


def _gguf_overhead(ckpt):
    # tensor data is the file minus its header and alignment padding: the header alone
    # accounts for under 4 MiB of SmolLM2's 98 MB file (tokenizer tables)
    overhead = default_model_path().stat().st_size - ckpt.weights_bytes
    assert 0 < overhead < 4 * 1024**2
    return overhead


def test_unknown_family_names_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "rwkv", "num_hidden_layers": 2}))
    with pytest.raises(ConfigError) as e:
        load_model_config(path)
    assert str(path) in str(e.value) and "model_type" in str(e.value) and "rwkv" in str(e.value)


@pytest.mark.parametrize("patch, field", [
    ({"num_hidden_layers": "32"}, "num_hidden_layers"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "wavy", "factor": 2}}, "rope_scaling.rope_type"),
])
def test_malformed_config_names_the_field(tmp_path, patch, field):
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | patch
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model_config(path)
    assert f"'{field}'" in str(e.value) and str(path) in str(e.value)


def test_missing_model_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("text, value", [("24GiB", 24 * GiB), ("512MB", 512_000_000), ("2g", 2 * GiB),
                                         ("1073741824", GiB), (4096, 4096)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="2GiB"):
        parse_bytes("lots")


def test_training_estimate_llama_8b():
    spec = load_model_config(CONFIGS / "llama-3.1-8b.json")
    t = plan_training(spec, 4096, micro_batch=1, param_dtype="bf16")
    assert 8.0e9 < t.parameters < 8.1e9  # Llama-3.1-8B has 8.03 B parameters
    assert t.optimizer_bytes == t.parameters * (2 * 4 + 4)
    assert t.activations_checkpointed_bytes < t.activations_bytes
    assert t.total_bytes == t.weights_bytes + t.gradients_bytes + t.optimizer_bytes + t.activations_bytes


def test_parameter_count_deepseek_v3():
    from ctxwarden.plan.params import count_parameters

    n = count_parameters(load_model_config(CONFIGS / "deepseek-v3.json"))
    assert 650e9 < n < 690e9  # published: 671 B total (main model 657 B + 14 B MTP)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ctxwarden", "plan", *args], capture_output=True, text=True)


def test_plan_cli_json_and_plot(tmp_path):
    png = tmp_path / "kv.png"
    out = _cli(str(CONFIGS / "gemma-2-9b.json"), "--context", "32768", "--json", "--plot", str(png),
               "--memory", "80GiB", "--train")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for key in ("kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_per_sequence_blocks",
                "weights_bytes", "num_blocks", "max_tokens_in_pool", "max_concurrency", "max_context",
                "layer_kinds", "train"):
        assert key in d
    assert d["kv_bytes_per_sequence"] == 21 * 8192 * (32_768 + 4096)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_cli_errors_are_one_line_not_tracebacks(tmp_path):
    out = _cli(str(tmp_path / "missing.gguf"))
    assert out.returncode == 2 and "Traceback" not in out.stderr and "does not exist" in out.stderr
    out = _cli("--context", "0")
    assert out.returncode == 2 and "--context must be >= 1" in out.stderr


@pytest.mark.parametrize("name, billions", [
    ("llama-3.1-8b", 8.03), ("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19), ("mistral-7b-v0.1", 7.24),
    ("gemma-2-9b", 9.24), ("phi-3-mini-128k-instruct", 3.82), ("smollm2-135m-instruct", 0.135),
])
def test_parameter_counts_match_published_sizes(name, billions):
    from ctxwarden.plan.params import count_parameters

    n = count_parameters(load_model_config(CONFIGS / f"{name}.json"))
    assert abs(n / 1e9 - billions) / billions < 0.01


def test_an_unknown_checkpoint_dtype_is_a_config_error_not_two_bytes():
    raw = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    with pytest.raises(ConfigError, match="torch_dtype.*'int3'"):
        parse_model_config({**raw, "torch_dtype": "int3"}, source="x.json")
