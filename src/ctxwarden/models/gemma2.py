"""Gemma 2: the llama decoder with four changes, each an override below.

- embeddings scaled by sqrt(hidden) (the factor rounded to the weights' dtype, as trained);
- RMSNorm scales by (1 + w), and each sub-block is sandwiched: a norm before and after
  attention and before and after the MLP;
- attention scores are scaled by query_pre_attn_scalar^-0.5 and soft-capped
  (cap * tanh(s / cap)); the final logits are soft-capped too;
- layers alternate sliding-window (even) and global (odd) attention; the window comes from
  the KV layout, which reads the spec's layer_types.
"""

from __future__ import annotations

import math

import torch

from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.layers.linear import linear
from ctxwarden.layers.mlp import gated_mlp
from ctxwarden.models.llama import LayerWeights, LlamaForCausalLM
from ctxwarden.runner.attention import AttentionParams


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder over the paged KV cache."""

    norm_offset = 1.0

    @classmethod
    def expected_tensors(cls, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """The llama set plus the sandwich norms of every layer."""
        out = super().expected_tensors(spec)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            out[p + "pre_feedforward_layernorm.weight"] = (spec.hidden_size,)
            out[p + "post_feedforward_layernorm.weight"] = (spec.hidden_size,)
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        normalizer = torch.tensor(math.sqrt(self.spec.hidden_size), dtype=self.dtype)
        return super().embed(input_ids) * normalizer

    def attention_params(self, layer_id, kv_cache) -> AttentionParams:
        layer = kv_cache.layer(layer_id)
        scalar = self.spec.query_pre_attn_scalar or self.spec.head_dim
        return AttentionParams(scalar ** -0.5, self.spec.attn_logit_softcapping,
                               layer.window_tokens, layer.sink_tokens)

    def decoder_layer(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        h = self.norm(x, w.input_norm)
        attn = self.attention(layer_id, w, h, step, rope, kv_cache, backend)
        x = x + self.norm(attn, w.post_attn_norm)
        mlp = gated_mlp(self.norm(x, w.pre_ffn_norm), w.gate_up, w.down, self.act)
        return x + self.norm(mlp, w.post_ffn_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
