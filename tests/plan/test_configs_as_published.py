"""Configs as published: fields a config.json leaves out take the transformers defaults.

The oracle is transformers itself (a test dependency): each minimal config is handed to the
family's config class, and every field the planner and the runner read must agree with our
ModelSpec. A second pass drops each field of each config in turn, so every default of every
family is checked against the class, not against a number copied into this file.
"""

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ctxwarden.errors import ConfigError
from ctxwarden.plan import plan_memory
from ctxwarden.spec.model_spec import (
    FULL, SLIDING, SUPPORTED_FAMILIES, load_model_config, parse_model_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
MINIMAL = CONFIGS / "minimal"
NAMES = sorted(p.stem for p in MINIMAL.glob("*.json"))
WITH_FULL = [n for n in NAMES if (CONFIGS / f"{n}.json").exists()]
GiB = 1024**3
# Fields that are metadata, not architecture: dropping them says nothing about defaults.
NOT_ARCHITECTURE = {"model_type", "architectures", "transformers_version", "torch_dtype", "dtype",
                    "bos_token_id", "eos_token_id", "pad_token_id"}


def raw(name: str) -> dict:
    return json.loads((MINIMAL / f"{name}.json").read_text())


def hf_configs(config: dict):
    """(the language model's transformers config, the top-level one) for a config dict."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    logging.set_verbosity_error()
    top = CONFIG_MAPPING[config["model_type"]].from_dict(copy.deepcopy(config))
    return getattr(top, "text_config", None) or top, top


def _rope_fields(d: dict) -> tuple:
    params = {k: v for k, v in d.items()
              if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    return (d["rope_type"], float(d["rope_theta"]), float(d.get("partial_rotary_factor", 1.0)),
            params)


def expected_from_transformers(config: dict) -> dict:
    """What transformers' classes and modeling code read, in ModelSpec's terms."""
    hf, top = hf_configs(config)
    n, heads = hf.num_hidden_layers, hf.num_attention_heads
    window = getattr(hf, "sliding_window", None)
    # Families without `layer_types` (llama, mistral, phi3) slide every layer iff a window is set.
    kinds = tuple(getattr(hf, "layer_types", None) or ((SLIDING if window else FULL),) * n)
    rope = hf.rope_parameters
    nested = FULL in rope
    out = {
        "num_layers": n, "hidden_size": hf.hidden_size, "num_attention_heads": heads,
        "num_kv_heads": hf.num_key_value_heads, "intermediate_size": hf.intermediate_size,
        # the modeling files: getattr(config, "head_dim", None) or hidden // heads
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "vocab_size": hf.vocab_size, "max_position_embeddings": hf.max_position_embeddings,
        "layer_types": kinds, "sliding_window": window if SLIDING in kinds else None,
        "rms_norm_eps": hf.rms_norm_eps, "tie_word_embeddings": top.tie_word_embeddings,
        "rope": _rope_fields(rope[FULL] if nested else rope),
        "rope_local": _rope_fields(rope[SLIDING]) if nested else None,
        "hidden_act": getattr(hf, "hidden_activation", None) or hf.hidden_act,
    }
    for name in ("attention_bias", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping"):
        if hasattr(hf, name):
            out[name] = getattr(hf, name)
    if hasattr(hf, "kv_lora_rank"):
        out["mla"] = tuple(getattr(hf, k) for k in ("kv_lora_rank", "qk_rope_head_dim",
                                                    "qk_nope_head_dim", "v_head_dim", "q_lora_rank"))
        out["moe"] = {k: getattr(hf, k) for k in ("n_routed_experts", "n_shared_experts",
                                                  "moe_intermediate_size", "first_k_dense_replace",
                                                  "num_experts_per_tok")}
    return out


def ours(spec) -> dict:
    """The same fields from our ModelSpec."""
    def rope(r):
        return None if r is None else (r.rope_type, r.theta, r.partial_rotary_factor, dict(r.params))

    out = {k: getattr(spec, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
        "head_dim", "vocab_size", "max_position_embeddings", "layer_types", "sliding_window",
        "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias",
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")}
    out["rope"], out["rope_local"] = rope(spec.rope), rope(spec.rope_local)
    if spec.mla is not None:
        m = spec.mla
        out["mla"] = (m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim,
                      m.q_lora_rank)
        out["moe"] = {k: spec.moe.get(k) for k in ("n_routed_experts", "n_shared_experts",
                                                   "moe_intermediate_size",
                                                   "first_k_dense_replace", "num_experts_per_tok")}
    return out


def assert_agrees(config: dict, label: str) -> None:
    want = expected_from_transformers(config)
    got = ours(parse_model_config(config, source=label))
    if want["rope_local"] is None and got["rope_local"] is not None:
        # one RoPE for all layers in transformers; ours names the sliding one separately
        want["rope_local"] = got["rope_local"]
    diff = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert not diff, f"{label}: (ours, transformers) differ: {diff}"


def test_every_supported_family_has_a_minimal_config():
    families = {raw(n)["model_type"] for n in NAMES}
    families |= {raw(n)["text_config"]["model_type"] for n in NAMES if "text_config" in raw(n)}
    # "smollm" is no transformers model_type (SmolLM2 publishes "llama"); see the test below.
    assert set(SUPPORTED_FAMILIES) - {"smollm"} <= families


@pytest.mark.parametrize("name", NAMES)
def test_minimal_config_agrees_with_transformers(name):
    assert_agrees(raw(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_each_dropped_field_takes_the_class_default(name):
    config = raw(name)
    inner = config.get("text_config", config)
    checked = 0
    for key in sorted(set(inner) - NOT_ARCHITECTURE):
        dropped = copy.deepcopy(config)
        dropped.get("text_config", dropped).pop(key)
        try:
            hf, _ = hf_configs(dropped)
        except Exception:  # the class itself refuses the result (e.g. hidden % heads)
            continue
        if (refused := _no_model_could(hf)) is not None:
            with pytest.raises(ConfigError, match=refused):
                parse_model_config(dropped, source=name)
            continue
        assert_agrees(dropped, f"{name} without {key}")
        checked += 1
    assert checked >= 1


def _no_model_could(hf) -> str | None:
    """The field we refuse when a config class accepts shapes no model can have."""
    if hf.num_attention_heads % hf.num_key_value_heads:
        return "num_key_value_heads"
    if getattr(hf, "head_dim", None) is None and hf.hidden_size % hf.num_attention_heads:
        return "head_dim"
    return None


@pytest.mark.parametrize("name", WITH_FULL)
def test_minimal_config_plans_exactly_as_the_full_one(name):
    minimal = load_model_config(MINIMAL / f"{name}.json")
    full = load_model_config(CONFIGS / f"{name}.json")
    assert replace(minimal, source="x") == replace(full, source="x")
    plans = [plan_memory(s, memory_bytes=80 * GiB, weights_bytes=2 * GiB, weights_source="test",
                         activation_reserve_bytes=GiB, context_tokens=32_768,
                         max_batched_tokens=2048) for s in (minimal, full)]
    a, b = (p.to_dict() for p in plans)
    assert a["kv_bytes_per_token"] > 0
    assert {k: v for k, v in a.items() if k not in ("model", "defaulted")} == \
           {k: v for k, v in b.items() if k not in ("model", "defaulted")}


FACTORS_48 = [1.0 + i / 48 for i in range(48)]  # Phi-3's 96-dim heads rotate 48 pairs

# The rules no published fixture reaches, each checked against transformers the same way.
RULES = {
    **{f"{f} with nothing but its model_type": {"model_type": f}
       for f in SUPPORTED_FAMILIES if f != "smollm"},
    "qwen2 sliding on, max_window_layers left out": {"model_type": "qwen2", "use_sliding_window": True},
    "qwen3 sliding on, own window": {"model_type": "qwen3", "use_sliding_window": True,
                                     "sliding_window": 1024, "num_hidden_layers": 40},
    "smollm3 sliding on: only NoPE layers slide": {"model_type": "smollm3", "use_sliding_window": True,
                                                   "sliding_window": 2048},
    "smollm3 own NoPE interval": {"model_type": "smollm3", "use_sliding_window": True,
                                  "sliding_window": 2048, "no_rope_layer_interval": 3},
    "phi3 yarn is read as longrope, trained length 4096": {
        "model_type": "phi3", "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "long_factor": FACTORS_48, "short_factor": FACTORS_48}},
    "phi3: its top-level trained length beats the rope dict's": {
        "model_type": "phi3", "original_max_position_embeddings": 8192,
        "rope_scaling": {"type": "longrope", "long_factor": FACTORS_48, "short_factor": FACTORS_48,
                         "original_max_position_embeddings": 2048}},
    "llama yarn: trained length from max_position_embeddings": {
        "model_type": "llama", "max_position_embeddings": 32768,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "mistral 5.x flat rope_parameters without theta": {
        "model_type": "mistral", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
    "gemma3_text 5.x nested, sliding base only": {
        "model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_theta": 5e4},
                                                         "full_attention": {"rope_type": "default"}}},
    "gemma3_text 4.x, own local base": {"model_type": "gemma3_text", "rope_local_base_freq": 2e4,
                                        "rope_theta": 5e5, "sliding_window_pattern": 4},
    "gemma the legacy gelu": {"model_type": "gemma", "hidden_act": "gelu"},
    "deepseek_v2 without query LoRA": {"model_type": "deepseek_v2", "q_lora_rank": None},
    "gemma3 wrapper with an unnamed text model": {"model_type": "gemma3",
                                                  "text_config": {"num_hidden_layers": 12}},
}


@pytest.mark.parametrize("label", sorted(RULES))
def test_family_rule_agrees_with_transformers(label):
    assert_agrees(RULES[label], label)


def test_gemma3_27b_it_as_published_is_planned_and_says_what_it_defaulted():
    spec = load_model_config(MINIMAL / "gemma-3-27b-it.json")
    assert spec.vocab_size == 262_208 and spec.max_position_embeddings == 131_072
    assert spec.layer_types.count(FULL) == 10 and spec.layer_types[5] == FULL
    assert spec.rope.theta == 1e6 and spec.rope.rope_type == "linear"
    assert spec.rope_local.theta == 10_000.0 and spec.rope_local.rope_type == "default"
    for field in ("vocab_size", "rope_theta", "rope_local_base_freq", "sliding_window_pattern",
                  "max_position_embeddings", "rms_norm_eps"):
        assert field in spec.defaulted, field
    assert spec.defaulted["vocab_size"] == 262_208 and spec.defaulted["sliding_window_pattern"] == 6
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "sliding_window"):
        assert field not in spec.defaulted, field  # the file has them


def test_absent_and_null_differ_where_transformers_says_so():
    # Mistral: no `sliding_window` means the class's 4096; an explicit null means no window.
    absent = load_model_config(MINIMAL / "mistral-7b-v0.1.json")
    null = load_model_config(MINIMAL / "mistral-7b-instruct-v0.2.json")
    assert absent.sliding_window == 4096 and absent.defaulted["sliding_window"] == 4096
    assert null.sliding_window is None and set(null.layer_types) == {FULL}
    # DeepSeek-V2-Lite writes q_lora_rank: null (no query LoRA), not the class's 1536.
    assert load_model_config(MINIMAL / "deepseek-v2-lite.json").mla.q_lora_rank is None


def test_a_null_where_the_class_wants_a_value_names_the_field_and_default(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw("qwen2.5-7b"), "rms_norm_eps": None}))
    with pytest.raises(ConfigError, match=r"'rms_norm_eps'.*null.*1e-06"):
        load_model_config(path)


def test_smollm_is_read_as_llama():
    config = raw("smollm2-135m-instruct")
    a = parse_model_config(config)
    b = parse_model_config({**config, "model_type": "smollm"})
    assert replace(b, model_type="llama") == a and dict(b.defaulted) == dict(a.defaulted)


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "ctxwarden", "plan", *args],
                          capture_output=True, text=True)


def test_plan_json_and_text_list_the_defaulted_fields():
    path = str(MINIMAL / "gemma-3-27b-it.json")
    out = _plan_cli(path, "--json", "--memory", "80GiB", "--context", "32768")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["defaulted"]["vocab_size"] == 262_208
    assert d["defaulted"]["rope_theta"] == 1e6 and d["defaulted"]["rope_local_base_freq"] == 1e4
    assert "hidden_size" not in d["defaulted"]
    assert d["kv_bytes_per_sequence"] == 8192 * (10 * 32_768 + 52 * 1024)
    text = _plan_cli(path, "--memory", "80GiB")
    assert text.returncode == 0, text.stderr
    assert "defaulted" in text.stdout and "vocab_size=262208" in text.stdout
    full = json.loads(_plan_cli(str(CONFIGS / "llama-3.1-8b.json"), "--json").stdout)
    assert full["defaulted"] == {"head_dim": 128}  # a complete file: only the derived head_dim
