"""What each family's transformers config class fills in when a config.json leaves a field out.

Published configs hold only what differs from the class defaults (transformers saves sub-configs
as a diff, so Gemma-3-27B-it's `text_config` has no `vocab_size`, `rope_theta`,
`sliding_window_pattern`, ...). To read them as transformers does, without importing it, this
module is the one place that knows those defaults:

- `FAMILY_DEFAULTS`: one row per family, the class's default for every field ctxwarden reads.
  Values are those of `transformers/models/<family>/configuration_<family>.py` (5.x, the
  version the tests compare against); `None` means the class defaults to None (off, or derived).
- the functions below it: defaults computed from other fields (head_dim, layer kinds, the
  trained length of scaled RoPE, old names of RoPE variants and activations).

A field is used as written when the file has it; `null` is accepted only where the class
accepts None (see `NULLABLE`). Everything here is plain data: no torch, no transformers.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

FULL = "full_attention"
SLIDING = "sliding_attention"

_LLAMA = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "rope_theta": 10_000.0,
}
_QWEN = {  # qwen2 and qwen3 share these; their differences are in the rows below
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10_000.0,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
}
_GEMMA2_ON = {  # gemma2 and gemma3_text: sliding layers, scaled queries, `hidden_activation`
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "rope_theta": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
_DEEPSEEK = {  # MLA dims and MoE shape; deepseek_v3 overrides most sizes
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "rope_theta": 10_000.0,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "first_k_dense_replace": 0, "n_routed_experts": 64,
    "n_shared_experts": 2, "moe_intermediate_size": 1407, "num_experts_per_tok": None,
    # routing (DeepseekV2TopkRouter): softmax scores, greedy or group-limited top-k
    "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None, "topk_group": None,
    "norm_topk_prob": False,
}

_GEMMA3_TEXT = {**_GEMMA2_ON, "vocab_size": 262_208, "max_position_embeddings": 131_072,
                "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                "sliding_window_pattern": 6, "final_logit_softcapping": None,
                "attn_logit_softcapping": None}

_ROWS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    # Not a transformers model_type (SmolLM and SmolLM2 publish "llama"): read as llama.
    "smollm": _LLAMA,
    "mistral": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    # Qwen2's class has no attention_bias: its attention always has q/k/v biases.
    "qwen2": {**_QWEN, "attention_bias": True},
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "phi3": {**_LLAMA, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "sliding_window": None},
    "smollm3": {**_LLAMA, "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36,
                "num_attention_heads": 16, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "tie_word_embeddings": True,
                "rope_theta": 2_000_000.0, "use_sliding_window": False, "sliding_window": None,
                "no_rope_layers": None, "no_rope_layer_interval": 4},
    "gemma": {**_LLAMA, "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
              "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
              "tie_word_embeddings": True},
    "gemma2": {**_GEMMA2_ON, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3": _GEMMA3_TEXT,  # a flat (not multimodal) "gemma3" config is read as its text model
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": {**_DEEPSEEK, "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "max_position_embeddings": 4096, "first_k_dense_replace": 3,
                    "n_routed_experts": 256, "n_shared_experts": 1,
                    "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
                    # V3 routes by sigmoid scores + a correction bias, top-2 sum per group
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "rope_interleave": True},
}
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {family: MappingProxyType(row) for family, row in _ROWS.items()})

# Configs of other families that list their own `layer_types`: no class to follow, so only
# the fallbacks ctxwarden has always used; every other field is required.
_GENERIC = MappingProxyType({
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "rope_theta": 10_000.0,
})

# Multimodal wrappers: the text model's type when `text_config` names none, and the wrapper's
# own defaults for what it decides (the top-level model ties the LM head).
MULTIMODAL_TEXT_TYPE = MappingProxyType({"gemma3": "gemma3_text"})
MULTIMODAL_DEFAULTS = MappingProxyType({"gemma3": {"tie_word_embeddings": True}})

# Fields a config may set to null: None means "off" (no window, no query LoRA, no cap) or
# "derive it" (KV heads, head_dim), as in the classes. Any other null is an error.
NULLABLE = frozenset({
    "num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank", "rope_scaling",
    "rope_parameters", "attn_logit_softcapping", "final_logit_softcapping",
    "num_experts_per_tok", "no_rope_layers", "n_group", "topk_group",
})

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")

Getter = Callable[[str, Any], Any]  # get(name, type): the file's value, else the family's


def family_defaults(family: str) -> Mapping[str, Any]:
    """The default row of `family`; "generic" (a config listing its layer kinds) gets a few."""
    return FAMILY_DEFAULTS.get(family, _GENERIC)


def activation_field(family: str) -> str:
    """Gemma-2 and Gemma-3 name their MLP activation `hidden_activation`; the rest `hidden_act`."""
    return "hidden_activation" if family in ("gemma2", "gemma3", "gemma3_text") else "hidden_act"


def normalise_activation(family: str, name: str) -> str:
    """Gemma's published "gelu" means the tanh approximation, as its class rewrites it."""
    return "gelu_pytorch_tanh" if family == "gemma" and name == "gelu" else name


def default_head_dim(family: str, get: Getter, hidden: int, heads: int) -> int | None:
    """head_dim when the config gives none: MLA's rope dim, else the class default or hidden/heads.

    Returns None when hidden/heads would be needed but does not divide (the caller names it).
    """
    if family in MLA_FAMILIES:  # the classes set head_dim = qk_rope_head_dim, always
        return get("qk_rope_head_dim", int)
    explicit = get("head_dim", int)  # qwen2, phi3, smollm3 have no default but read one given
    if explicit is not None:
        return explicit
    return hidden // heads if hidden % heads == 0 else None


def default_layer_types(family: str, get: Getter, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind by the family's own rule (the config lists none).

    Raises ValueError when the fields the rule reads disagree with each other.
    """
    if family == "gemma2":
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    if family in ("gemma3", "gemma3_text"):
        pattern = get("sliding_window_pattern", int)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if family in ("qwen2", "qwen3"):
        if not get("use_sliding_window", bool) or get("sliding_window", int) is None:
            return (FULL,) * num_layers
        first = get("max_window_layers", int)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    if family == "smollm3":
        return _smollm3_layer_types(get, num_layers)
    if family in ("mistral", "phi3") and get("sliding_window", int) is not None:
        return (SLIDING,) * num_layers  # one window on every layer
    return (FULL,) * num_layers


def _smollm3_layer_types(get: Getter, num_layers: int) -> tuple[str, ...]:
    # Only the NoPE layers (every 4th by default) slide, and only when sliding is on.
    if not get("use_sliding_window", bool) or get("sliding_window", int) is None:
        return (FULL,) * num_layers
    no_rope = get("no_rope_layers", list)
    if no_rope is None:
        interval = get("no_rope_layer_interval", int)
        no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(no_rope) != num_layers:
        raise ValueError(f"no_rope_layers has {len(no_rope)} entries, num_hidden_layers is {num_layers}")
    return tuple(SLIDING if not no_rope[i] else FULL for i in range(num_layers))


def rope_type_alias(family: str, rope_type: str) -> str:
    """Old names of RoPE variants: "su" is longrope; Phi-3's class reads "yarn" as longrope too."""
    if rope_type == "su" or (family == "phi3" and rope_type == "yarn"):
        return "longrope"
    return rope_type


def trained_positions(family: str, get: Getter, rope: Mapping[str, Any]) -> int:
    """`original_max_position_embeddings` of a scaled RoPE (llama3, yarn, longrope).

    Phi-3's class has its own top-level field (default 4096), which always wins; the others
    take the rope dict's value, else `max_position_embeddings`.
    """
    if family == "phi3":
        return get("original_max_position_embeddings", int)
    if rope.get("original_max_position_embeddings") is not None:
        return rope["original_max_position_embeddings"]
    return get("max_position_embeddings", int)
