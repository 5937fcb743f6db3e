"""Parameter counts from a ModelSpec alone (dense, GQA, MLA, and DeepSeek-style MoE).

Used when a plan is made from a bare config.json, and by the training estimate. When weight
files exist, the planner reads their headers instead: a header is exact, this is arithmetic.
"""

from __future__ import annotations

from ctxwarden.spec.model_spec import ModelSpec


def count_parameters(spec: ModelSpec) -> int:
    """Total parameters: embeddings, every layer's attention + MLP + norms, the LM head."""
    embed = spec.vocab_size * spec.hidden_size
    head = 0 if spec.tie_word_embeddings else embed
    layers = sum(_attention_params(spec) + _mlp_params(spec, i) + _norm_params(spec)
                 for i in range(spec.num_layers))
    return embed + head + layers + spec.hidden_size  # + final norm


def _attention_params(spec: ModelSpec) -> int:
    h, n, d = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    if spec.mla is not None:
        m = spec.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk_dim
             if m.q_lora_rank else h * n * qk_dim)
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_b = m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv_a + kv_b + n * m.v_head_dim * h
    kv = spec.num_kv_heads * d
    weights = h * n * d + 2 * h * kv + n * d * h
    bias = (n * d + 2 * kv) if spec.attention_bias else 0
    qk_norm = 2 * d if spec.qk_norm else 0
    return weights + bias + qk_norm


def _mlp_params(spec: ModelSpec, layer_id: int) -> int:
    h = spec.hidden_size
    moe = spec.moe
    routed = moe.get("n_routed_experts") or moe.get("num_experts")
    if routed and layer_id >= moe.get("first_k_dense_replace", 0):
        inter = moe.get("moe_intermediate_size", spec.intermediate_size)
        shared = moe.get("n_shared_experts", 0)
        return (routed + shared) * 3 * h * inter + h * routed  # experts + router
    return 3 * h * spec.intermediate_size  # gate, up, down


def _norm_params(spec: ModelSpec) -> int:
    norms = 4 if spec.model_type.startswith(("gemma2", "gemma3")) else 2
    return norms * spec.hidden_size
