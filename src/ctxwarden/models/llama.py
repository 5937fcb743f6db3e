"""The llama family: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), phi3 (fused).

Pre-norm decoder, read top to bottom:

    x = embed(ids)                                   # [T, hidden]
    for each layer:
        h = rms_norm(x);  q, k, v = split(h @ Wqkv)  # one matmul for q, k and v
        q, k = rope(q), rope(k); cache <- k, v        # k stored rotated
        x = x + o(attention(q, paged k/v))
        x = x + mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))[rows asked for]

Tokens of every sequence of a step are flattened into one [T, ...] batch; only attention
looks at sequence boundaries (through StepInputs). Weights are kept as plain tensors (no
autograd, no nn.Module): q/k/v and gate/up are concatenated at load time so each costs one
matmul. Gemma2 (gemma2.py) subclasses this and overrides the few steps that differ.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ctxwarden.ext import kernels
from ctxwarden.spec.model_spec import ModelSpec
from ctxwarden.layers.linear import DENSE_MIN_ROWS, LinearWeight, decode_kernel, linear, pack_linear
from ctxwarden.layers.quant import QuantizedWeight, rows_of, stack_rows
from ctxwarden.layers.mlp import activation, gated_mlp
from ctxwarden.layers.norm import rms_norm
from ctxwarden.layers.rotary import RotaryEmbedding, apply_rotary
from ctxwarden.runner.attention import (IN_PLACE_POOL_DTYPES, AttentionBackend, AttentionParams,
                                        TorchPagedAttention)
from ctxwarden.runner.inputs import StepInputs
from ctxwarden.runner.kv_cache import PagedKVCache


# Steps of at most this many rows take the fused ext/ ops. Since those split their rows
# across threads and silu_mul is vectorized, prefill takes them too (a 2,048-token step of
# SmolLM2: see docs/runner.md); the bound stays for measuring the torch ops against them.
FUSED_MAX_ROWS = 1 << 62


@dataclass
class LayerWeights:
    """One decoder layer's tensors, in the runtime's fused layout."""

    input_norm: torch.Tensor
    qkv: LinearWeight  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: LinearWeight  # [hidden, Hq * D]
    q_norm: torch.Tensor | None  # [D] (qwen3)
    k_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor
    gate_up: LinearWeight  # [2 * inter, hidden]
    down: LinearWeight  # [hidden, inter]
    pre_ffn_norm: torch.Tensor | None = None  # gemma2 only
    post_ffn_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class StepRope:
    """Cos/sin tables of one step, per rotary variant (global / local) and per sink query."""

    tables: dict


class LlamaForCausalLM:
    """Inference-only llama-family decoder over a paged KV cache."""

    norm_offset = 0.0  # RMSNorm scales by (offset + w); gemma uses 1

    def __init__(self, spec: ModelSpec, embed: torch.Tensor | QuantizedWeight,
                 layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor | QuantizedWeight, dtype: torch.dtype | None = None):
        """`lm_head` may be `embed` itself (tied); layers hold packed projections.

        A quantized embedding (GGUF Q8_0 under weights=auto) stays quantized: lookups
        dequantize only the rows asked for, and the tied lm_head uses the same codes.
        """
        self.spec, self.embed_tokens, self.layers = spec, embed, layers
        # Where pack_linear reorders (bf16 in a bf16 model; fp32 without ext/'s vector path) a
        # tied lm_head becomes a copy of vocab x hidden (the lookup needs plain rows); a plain
        # fp32 or bf16 one with ext/ is the embedding's own tensor, multiplied by dense_linear
        # at decode.
        self.dtype = dtype or final_norm.dtype
        self.final_norm, self.lm_head = final_norm, pack_linear(lm_head, dense_dtype=self.dtype)
        self._whole_layer_cache: dict[int, tuple | None] = {}  # layer id -> decode_layer's weights
        self._stacks: dict[int, object | None] = {}  # id(kv_cache) -> ext DecodeStack, while it lives
        self.act = activation(spec.hidden_act)
        self.q_size = spec.num_attention_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings)
        self.rotary_local = (RotaryEmbedding(spec.rope_local, spec.head_dim,
                                             spec.max_position_embeddings)
                             if spec.rope_local is not None else None)

    def rope_cache_keys(self, num_prompt_tokens: int) -> tuple[bytes, ...]:
        """Prefix-cache salt for a prompt whose keys are rotated by its length (dynamic NTK or
        LongRoPE past the trained length): such KV is shared only with prompts of that length."""
        rotaries = (self.rotary, self.rotary_local)
        if any(r is not None and r.rotates_by_length(num_prompt_tokens) for r in rotaries):
            return (f"rope-length:{num_prompt_tokens}".encode(),)
        return ()

    # ---- loading -----------------------------------------------------------------------

    @classmethod
    def expected_tensors(cls, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name this architecture reads, with its shape."""
        h, d = spec.hidden_size, spec.head_dim
        q, kv, inter = spec.num_attention_heads * d, spec.num_kv_heads * d, spec.intermediate_size
        out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = (spec.vocab_size, h)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, inter)})
            out.update(cls._projection_names(spec, p, q, kv))
        return out

    @classmethod
    def _projection_names(cls, spec: ModelSpec, p: str, q: int, kv: int) -> dict:
        h, inter = spec.hidden_size, spec.intermediate_size
        if spec.model_type == "phi3":
            return {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                    p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        out = {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
               p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (inter, h),
               p + "mlp.up_proj.weight": (inter, h)}
        if spec.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if spec.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (spec.head_dim,),
                        p + "self_attn.k_norm.weight": (spec.head_dim,)})
        return out

    @classmethod
    def from_weights(cls, spec: ModelSpec, source, dtype: torch.dtype, weights: str = "fp32"):
        """Build the model from a checked WeightSource, reading each tensor once.

        `weights` (loader.WEIGHTS_MODES) says how projections are stored; norms stay in
        `dtype`. A tied embedding shares the lm_head's codes when that is quantized.
        """
        name = "model.embed_tokens.weight"
        # The lm_head is the one projection every token's logits go through: int4 keeps it
        # at 8 bits (4-bit logits cost SmolLM2 +8.7% perplexity, 8-bit +0.2%), as
        # llama.cpp's converters keep their output tensor at higher precision.
        head_mode = "int8" if weights == "int4" else weights
        if spec.tie_word_embeddings:
            lm_head = source.get_linear(name, head_mode, dtype)
            # a quantized table serves lookups too (rows dequantized on demand), and so does
            # a dense one in `dtype` or bf16 (rows widened on lookup): one copy of vocab x
            # hidden, not two
            shared = isinstance(lm_head, QuantizedWeight) or lm_head.dtype in (dtype, torch.bfloat16)
            embed = lm_head if shared else source.get(name, dtype)
        else:
            embed = source.get(name, dtype)
            lm_head = source.get_linear("lm_head.weight", head_mode, dtype)
        layers = [cls._load_layer(spec, source, f"model.layers.{i}.", dtype, weights)
                  for i in range(spec.num_layers)]
        return cls(spec, embed, layers, source.get("model.norm.weight", dtype), lm_head, dtype)

    @classmethod
    def _load_layer(cls, spec: ModelSpec, source, p: str, dtype: torch.dtype,
                    weights: str) -> LayerWeights:
        def get(name):
            return source.get(p + name, dtype)

        # A quantized weight is expanded for prefill-sized steps in the activations' dtype,
        # not bf16: a recompute after preemption re-runs decoded tokens as one prefill, and
        # must give the KV the decode steps wrote (the engine's pressure == no pressure).
        def proj(*names):  # one projection, or several stacked along out_features
            parts = [source.get_linear(p + n, weights, dtype) for n in names]
            return pack_linear(parts[0] if len(parts) == 1 else stack_rows(parts), dense_dtype=dtype)

        def opt(name):
            return get(name) if p + name in source.infos else None

        if spec.model_type == "phi3":
            qkv, gate_up, bias = proj("self_attn.qkv_proj.weight"), proj("mlp.gate_up_proj.weight"), None
        else:
            qkv = proj(*(f"self_attn.{x}_proj.weight" for x in "qkv"))
            gate_up = proj("mlp.gate_proj.weight", "mlp.up_proj.weight")
            bias = (torch.cat([get(f"self_attn.{x}_proj.bias") for x in "qkv"])
                    if spec.attention_bias else None)
        return LayerWeights(
            input_norm=get("input_layernorm.weight"), qkv=qkv, qkv_bias=bias,
            o=proj("self_attn.o_proj.weight"), q_norm=opt("self_attn.q_norm.weight") if spec.qk_norm else None,
            k_norm=opt("self_attn.k_norm.weight") if spec.qk_norm else None,
            post_attn_norm=get("post_attention_layernorm.weight"), gate_up=gate_up,
            down=proj("mlp.down_proj.weight"),
            pre_ffn_norm=opt("pre_feedforward_layernorm.weight"),
            post_ffn_norm=opt("post_feedforward_layernorm.weight"))

    # ---- forward -----------------------------------------------------------------------

    @property
    def weights_bytes(self) -> int:
        """Bytes of every weight tensor held (tied embeddings counted once; the lm_head's
        reordered copy counted on its own, since it is memory held)."""
        held = [self.embed_tokens, self.final_norm, self.lm_head]
        for layer in self.layers:
            held += [t for t in vars(layer).values() if t is not None]
        return sum(_held_tensors(held).values())

    def forward(self, step: StepInputs, kv_cache: PagedKVCache, backend: AttentionBackend
                ) -> torch.Tensor:
        """Hidden states [R, hidden] (after the final norm) of the rows logits are asked for."""
        rope = self._step_rope(step, kv_cache)
        x = self.embed(step.input_ids)  # [T, hidden]
        whole = self._whole_step(x, step, rope, kv_cache, backend)
        if whole is not None:  # every layer in one ext/ call (x updated in place)
            stack, inputs = whole
            stack.run(x, *inputs)
        else:
            for layer_id, w in enumerate(self.layers):
                x = self.decoder_layer(layer_id, w, x, step, rope, kv_cache, backend)
        x = x.index_select(0, step.logits_indices)  # only the rows sampled: the lm_head is the largest matmul
        if self._is_fused_step(x) and self.final_norm.dtype == torch.float32:  # one ext call, not ~6 torch ops
            return kernels().rms_norm(x, self.final_norm, self.spec.rms_norm_eps, self.norm_offset)
        return self.norm(x, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] in fp32 from final hidden states [R, hidden]."""
        return linear(hidden, self.lm_head).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, QuantizedWeight):
            return rows_of(self.embed_tokens, input_ids).to(self.dtype)
        rows = self.embed_tokens.index_select(0, input_ids)  # not [ids]: see attention._gather
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.spec.rms_norm_eps, self.norm_offset)

    def attention_params(self, layer_id: int, kv_cache: PagedKVCache) -> AttentionParams:
        layer = kv_cache.layer(layer_id)
        return AttentionParams(self.spec.head_dim ** -0.5, self.spec.attn_logit_softcapping,
                               layer.window_tokens, layer.sink_tokens)

    def decoder_layer(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        if self._is_fused_step(x):
            return self._fused_decoder_layer(layer_id, w, x, step, rope, kv_cache, backend)
        h = self.norm(x, w.input_norm)
        x = x + self.attention(layer_id, w, h, step, rope, kv_cache, backend)
        return x + gated_mlp(self.norm(x, w.post_attn_norm), w.gate_up, w.down, self.act)

    def _is_fused_step(self, x: torch.Tensor) -> bool:
        """Few fp32 rows and a plain llama layer: the ext/ fused ops replace the small ops.

        A decode step's per-layer cost is mostly the dispatch of ~40 tiny torch ops; the
        fused ones (one norm, one rotate-and-write, one attention, ...) do the same math
        in ~10 calls. A prefill's rows are split across threads by the same ops, which also
        skip torch's temporaries (the rotated halves, the gathered cat, the pool's
        index_copy).
        """
        return (x.shape[0] <= FUSED_MAX_ROWS and x.dtype == torch.float32 and kernels() is not None
                and self.spec.hidden_act in ("silu", "swish") and not self.spec.qk_norm)

    def _fused_decoder_layer(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        whole = self._whole_layer_args(layer_id, w, x, step, rope, kv_cache, backend)
        if whole is not None:  # one ext/ call for the layer (x updated in place)
            kernels().decode_layer(x, *whole)
            return x
        return self._fused_layer_calls(layer_id, w, x, step, rope, kv_cache, backend)

    def _fused_layer_calls(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        """The fused layer as ~10 calls from Python (ext/'s decode_layer makes them in one)."""
        ext, eps = kernels(), self.spec.rms_norm_eps
        h = ext.rms_norm(x, w.input_norm, eps, self.norm_offset)
        attn = self.attention(layer_id, w, h, step, rope, kv_cache, backend)
        h = ext.add_rms_norm(x, attn, w.post_attn_norm, eps, self.norm_offset)  # x += attn
        return x.add_(linear(ext.silu_mul(linear(h, w.gate_up)), w.down))

    def _whole_layer_args(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        """Arguments of ext's decode_layer for this layer and step, or None where the layer
        must take the calls from Python: a subclass's own attention, biases or q/k norms,
        sinks, fp8 KV, prefill rows, a monitored backend, or a projection without a kernel."""
        inputs = self._whole_layer_inputs(layer_id, w, x, step, rope, kv_cache, backend)
        held = None if inputs is None else self._whole_layer_weights(layer_id, w)
        if held is None:
            return None
        cos, sin, slot_mapping, key_slots, num_keys, num_sink, scale, softcap = inputs
        layer = kv_cache.layer(layer_id)
        return (held[0], self.spec.rms_norm_eps, self.norm_offset, held[1], held[2], cos, sin, layer.key,
                layer.value, slot_mapping, self.spec.num_attention_heads, self.spec.num_kv_heads,
                self.spec.head_dim, key_slots, num_keys, num_sink, scale, softcap)

    def _whole_layer_inputs(self, layer_id, w: LayerWeights, x, step, rope, kv_cache, backend):
        """What a step gives one layer on the one-call path (cos, sin, slot mapping, key slots,
        key counts, sink counts, scale, softcap), or None where it must take the Python calls."""
        if (type(self).attention is not LlamaForCausalLM.attention or type(backend) is not TorchPagedAttention
                or x.shape[0] >= DENSE_MIN_ROWS or w.qkv_bias is not None):
            return None
        layer, group, cos, sin, sink = self._layer_inputs(layer_id, step, rope, kv_cache)
        if (not self._rotates_in_one_call(w, layer, sink, x) or group.decode is None
                or layer.key.dtype not in IN_PLACE_POOL_DTYPES):
            return None
        dk, params = group.decode, self.attention_params(layer_id, kv_cache)
        return (cos, sin, group.slot_mapping, dk.key_slots, dk.num_keys, dk.num_sink_keys, params.scale,
                params.softcap or 0.0)

    def _whole_step(self, x, step, rope, kv_cache, backend):
        """(ext's DecodeStack, this step's inputs to it) where every layer takes the one-call
        path with the same inputs; the step's layers then run in one call and one parallel
        region (the threads wake once per step instead of once per layer). None otherwise."""
        if type(self).decoder_layer is not LlamaForCausalLM.decoder_layer or not self._is_fused_step(x):
            return None
        inputs = self._whole_layer_inputs(0, self.layers[0], x, step, rope, kv_cache, backend)
        stack = None if inputs is None else self._decode_stack(kv_cache)
        return None if stack is None else (stack, inputs)

    def _decode_stack(self, kv_cache: PagedKVCache):
        """ext's DecodeStack over every layer and its KV pool pair, built once per KV cache and
        dropped with it; None where layers differ in what a step gives them (KV group, rotary
        table, attention parameters) or one has no one-call path."""
        key = id(kv_cache)
        if key not in self._stacks:
            self._stacks[key] = self._build_stack(kv_cache)
            weakref.finalize(kv_cache, self._stacks.pop, key, None)
        return self._stacks[key]

    def _build_stack(self, kv_cache: PagedKVCache):
        ext = kernels()
        if not hasattr(ext, "DecodeStack"):
            return None
        layers = [kv_cache.layer(i) for i in range(len(self.layers))]
        local = [self.rotary_local is not None and self.spec.rope_for_layer(i) is self.spec.rope_local
                 for i in range(len(self.layers))]
        params = [self.attention_params(i, kv_cache) for i in range(len(self.layers))]
        held = [self._whole_layer_weights(i, w) for i, w in enumerate(self.layers)]
        same = all(l.group_index == layers[0].group_index and f == local[0] and p == params[0]
                   for l, f, p in zip(layers, local, params))
        if (not same or any(h is None for h in held) or layers[0].fp8_dtype is not None
                or any(w.qkv_bias is not None or w.q_norm is not None for w in self.layers)):
            return None
        spec = self.spec
        return ext.DecodeStack([t for h in held for t in h[0]], [t for h in held for t in h[1]],
                               [m for h in held for m in h[2]], [l.key for l in layers],
                               [l.value for l in layers], spec.hidden_size, spec.intermediate_size,
                               spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                               spec.rms_norm_eps, self.norm_offset)

    def _whole_layer_weights(self, layer_id: int, w: LayerWeights):
        """(norms, 12 weight tensors, 4 modes) for decode_layer, built once per layer; None
        when a projection has no ext/ kernel at decode (a reordered bf16 weight)."""
        if layer_id not in self._whole_layer_cache:
            kernels_of = [decode_kernel(lw) for lw in (w.qkv, w.o, w.gate_up, w.down)]
            self._whole_layer_cache[layer_id] = None if None in kernels_of else (
                [w.input_norm, w.post_attn_norm], [t for _, ts in kernels_of for t in ts],
                [mode for mode, _ in kernels_of])
        return self._whole_layer_cache[layer_id]

    def _layer_inputs(self, layer_id: int, step: StepInputs, rope: StepRope, kv_cache: PagedKVCache):
        """(its KV, its group's step inputs, cos, sin, sink table or None) for one layer."""
        layer = kv_cache.layer(layer_id)
        local = self.rotary_local is not None and self.spec.rope_for_layer(layer_id) is self.spec.rope_local
        cos, sin = rope.tables[("tok", local)]
        return layer, step.groups[layer.group_index], cos, sin, rope.tables.get(("sink", local, layer.group_index))

    def _rotates_in_one_call(self, w: LayerWeights, layer, sink, h) -> bool:
        """Whether ext's rope_write_kv rotates q/k and writes k/v for this layer and step."""
        return ((sink is None or not layer.sink_tokens) and w.q_norm is None and layer.fp8_dtype is None
                and self._is_fused_step(h))

    def attention(self, layer_id, w: LayerWeights, h, step: StepInputs, rope: StepRope,
                  kv_cache: PagedKVCache, backend: AttentionBackend) -> torch.Tensor:
        """Self-attention of one layer: project, rotate, write the cache, attend, project."""
        t, d = h.shape[0], self.spec.head_dim
        qkv = linear(h, w.qkv)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        layer, group, cos, sin, sink = self._layer_inputs(layer_id, step, rope, kv_cache)
        if self._rotates_in_one_call(w, layer, sink, h):
            # rotate q and k, write k and v to their pages, in one call (ext/kernels.cpp)
            q = kernels().rope_write_kv(qkv, cos, sin, layer.key, layer.value, group.slot_mapping,
                                        self.spec.num_attention_heads, self.spec.num_kv_heads, d)
            out = backend.forward(q, None, layer, group, self.attention_params(layer_id, kv_cache))
            return linear(out.reshape(t, self.q_size), w.o)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if w.q_norm is not None:
            q, k = self.norm(q, w.q_norm), self.norm(k, w.k_norm)
        q_sink = apply_rotary(q, *sink) if sink is not None and layer.sink_tokens else None
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv_cache.write(layer, k, v, step.groups[layer.group_index].slot_mapping)
        out = backend.forward(q, q_sink, layer, step.groups[layer.group_index],
                              self.attention_params(layer_id, kv_cache))
        return linear(out.reshape(t, self.q_size), w.o)

    def _step_rope(self, step: StepInputs, kv_cache: PagedKVCache) -> StepRope:
        """Cos/sin for every token of the step, per rotary in use, computed once per step."""
        tables = {}
        for local, rotary in ((False, self.rotary), (True, self.rotary_local)):
            if rotary is None:
                continue
            tables[("tok", local)] = rotary.cos_sin(step.positions, step.rope_seq_lens)
            for g, group in enumerate(step.groups):
                if group.sink_query_positions is not None:
                    tables[("sink", local, g)] = rotary.cos_sin(group.sink_query_positions,
                                                                step.rope_seq_lens)
        return StepRope(tables)


def _held_tensors(held: list) -> dict[int, int]:
    """Bytes per distinct tensor under weights, packed weights and quantized codes."""
    out = {}
    for item in held:
        quant = getattr(item, "quant", None) or (item if isinstance(item, QuantizedWeight) else None)
        tensors = ([t for t in (quant.codes, quant.scale, quant.zero, getattr(item, "panels", None))
                    if t is not None] if quant else [getattr(item, "weight", item)])
        out.update({id(t): t.nbytes for t in tensors})
    return out
