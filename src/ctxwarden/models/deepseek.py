"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over the paged cache, and MoE.

One layer, read top to bottom (H heads, r = kv_lora_rank, dn / dr / dv = nope / rope / v dims):

    h = rms_norm(x)
    q = q_b(rms_norm(q_a(h)))  or  q_proj(h)          # [T, H, dn + dr]
    latent, k_pe = kv_a(h)                             # [T, r], [T, dr]: one "head" per token
    latent = rms_norm(latent);  q_pe, k_pe = rope(q_pe), rope(k_pe)
    cache <- [latent | k_pe]                           # cache_dim = r + dr values per token
    q_lat = q_nope @ W_uk[h]                           # absorbed: [T, H, r], no keys expanded
    o_lat = softmax(scale * [q_lat | q_pe] . [latent | k_pe]) @ [latent | k_pe]   (MQA, 1 KV head)
    x = x + o(o_lat[..., :r] @ W_uv[h].T)              # [T, H, dv] -> hidden
    x = x + (dense MLP for the first `first_k_dense_replace` layers, else MoE)(rms_norm(x))

Why absorbed: q_nope . (W_uk latent) = (W_uk^T q_nope) . latent, and sum p (W_uv latent) =
W_uv (sum p latent), so attention runs on the cached rows as they are, through the same
paged backend (one KV head of cache_dim) as every other model: the cache never holds
per-head keys, and a decode step costs H x (dn + dv) x r per token for the two
absorptions instead of expanding every cached token. The value is the cached row itself
(its rope part is ignored afterwards), so the pool stores each row once.

Prefill is the exception. Per head, absorbing costs r (dn + dv) per query (q_nope in,
the output back out) and 2 (r + dr) per (query, key) pair; expanding costs r (dn + dv) per
key read and dn + dr + dv per pair. With n new tokens reading m keys, expanding is cheaper
iff r (dn + dv) (m - n) < n m (2 r + dr - dn - dv): always for a prompt's first chunk
(m == n), never for a decode step, and for a later chunk once it is long against what is
cached. Decode steps go absorbed through the paged backend (its in-place decode kernel);
every other step decides per sequence (in a mixed step the decodes absorb and the prompts
expand), the absorbed case folding its H query heads into rows over the one KV head.
benchmarks/mla_attention.py measures both paths on a V2-Lite-shaped layer: the rule picks
the faster one at all 13 points measured. Either way the cache holds the same latent rows.

Rotary: DeepSeek's weights rotate interleaved pairs (x0, x1), (x2, x3), ...; the rope rows
of the q and kv_a projections are reordered at load time (evens, then odds) so the
NeoX-style half split of layers/rotary.py applies: dot products are unchanged. The softmax
scale is qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim, as trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ctxwarden.errors import ConfigError
from ctxwarden.layers.linear import LinearWeight, linear, pack_linear
from ctxwarden.layers.mlp import gated_mlp
from ctxwarden.layers.moe import MoEWeights, Routing, moe_forward
from ctxwarden.layers.quant import stack_rows
from ctxwarden.layers.rotary import apply_rotary
from ctxwarden.models.llama import LlamaForCausalLM, _held_tensors
from ctxwarden.runner.attention import AttentionParams, attend_gathered
from ctxwarden.spec.model_spec import ModelSpec


@dataclass
class MLALayerWeights:
    """One DeepSeek layer's tensors (rope rows already in half-split order)."""

    input_norm: torch.Tensor
    q: LinearWeight | None  # q_proj [H (dn + dr), hidden] without query LoRA
    q_a: LinearWeight | None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None
    q_b: LinearWeight | None  # [H (dn + dr), q_lora_rank]
    kv_a: LinearWeight  # [r + dr, hidden]
    kv_a_norm: torch.Tensor  # [r]
    w_uk: torch.Tensor  # [H, dn, r]: latent -> nope keys, absorbed into the queries
    w_uv_t: torch.Tensor  # [H, r, dv]: latent -> values, applied after attention
    kv_b: LinearWeight  # [H (dn + dv), r]: the same weights, for expanding long prefills
    o: LinearWeight  # [hidden, H dv]
    post_attn_norm: torch.Tensor
    mlp: tuple[LinearWeight, LinearWeight] | None  # dense layers: (gate_up, down)
    moe: MoEWeights | None


def routing_of(spec: ModelSpec) -> Routing:
    """The router's rule for this checkpoint (V2 softmax, V3 sigmoid with a bias)."""
    m = spec.moe
    v3 = spec.model_type == "deepseek_v3"
    return Routing(num_experts_per_tok=int(m["num_experts_per_tok"]),
                   scoring="sigmoid" if v3 else "softmax",
                   topk_method="noaux_tc" if v3 else m.get("topk_method", "greedy"),
                   num_groups=m.get("n_group"), topk_groups=m.get("topk_group"),
                   norm_topk_prob=bool(m.get("norm_topk_prob", False)),
                   routed_scaling_factor=float(m.get("routed_scaling_factor", 1.0)))


def softmax_scale(spec: ModelSpec) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a scaled RoPE (YaRN)."""
    m = spec.mla
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    p = spec.rope.params
    if spec.rope.rope_type != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * p["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def expansion_pays(m, num_new_tokens: int, num_keys: int) -> bool:
    """Whether expanding `num_keys` cached latents beats absorbing `num_new_tokens` queries
    (the per-head multiply-add counts of the module docstring; m is the MLAConfig)."""
    per_token = m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)
    per_pair_saved = 2 * m.kv_lora_rank + m.qk_rope_head_dim - m.qk_nope_head_dim - m.v_head_dim
    return per_token * (num_keys - num_new_tokens) < num_new_tokens * num_keys * per_pair_saved


def _is_moe_layer(spec: ModelSpec, layer_id: int) -> bool:
    return bool(spec.moe.get("n_routed_experts")) and layer_id >= spec.moe.get("first_k_dense_replace", 0)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3 decoder (MLA + MoE) over the paged KV cache; no MTP layers."""

    def __init__(self, spec: ModelSpec, embed, layers, final_norm, lm_head, dtype=None):
        super().__init__(spec, embed, layers, final_norm, lm_head, dtype)
        self.scale = softmax_scale(spec)
        self.force_path: str | None = None  # "absorbed" | "expanded": benchmarks and tests only
        self.routing = routing_of(spec) if any(w.moe is not None for w in layers) else None

    # ---- loading -----------------------------------------------------------------------

    @classmethod
    def expected_tensors(cls, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name DeepSeek's checkpoints hold (per-expert names)."""
        _check_supported(spec)
        h, m, heads = spec.hidden_size, spec.mla, spec.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = (spec.vocab_size, h)
        for i in range(spec.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                        a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                        a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                        a + "o_proj.weight": (h, heads * m.v_head_dim)})
            if m.q_lora_rank:
                out.update({a + "q_a_proj.weight": (m.q_lora_rank, h),
                            a + "q_a_layernorm.weight": (m.q_lora_rank,),
                            a + "q_b_proj.weight": (heads * qk, m.q_lora_rank)})
            else:
                out[a + "q_proj.weight"] = (heads * qk, h)
            out.update(_mlp_names(spec, i))
        return out

    @classmethod
    def from_weights(cls, spec: ModelSpec, source, dtype: torch.dtype, weights: str = "fp32"):
        """Build the model from a checked WeightSource (see LlamaForCausalLM.from_weights)."""
        head_mode = "int8" if weights == "int4" else weights
        embed = source.get("model.embed_tokens.weight", dtype)
        lm_head = (embed if spec.tie_word_embeddings
                   else source.get_linear("lm_head.weight", head_mode, dtype))
        layers = [_load_layer(spec, source, i, dtype, weights) for i in range(spec.num_layers)]
        return cls(spec, embed, layers, source.get("model.norm.weight", dtype), lm_head, dtype)

    @property
    def weights_bytes(self) -> int:
        """Bytes of every weight tensor held (experts included)."""
        held = [self.embed_tokens, self.final_norm, self.lm_head]
        for w in self.layers:
            held += [t for k, t in vars(w).items() if t is not None and k not in ("mlp", "moe")]
            held += list(w.mlp or ())
            if w.moe is not None:
                held += [w.moe.gate] + [x for pair in w.moe.experts for x in pair]
                held += list(w.moe.shared or ()) + ([w.moe.score_bias] if w.moe.score_bias is not None else [])
        return sum(_held_tensors(held).values())

    # ---- forward -----------------------------------------------------------------------

    def attention_params(self, layer_id, kv_cache) -> AttentionParams:
        layer = kv_cache.layer(layer_id)
        return AttentionParams(self.scale, None, layer.window_tokens, layer.sink_tokens)

    def decoder_layer(self, layer_id, w: MLALayerWeights, x, step, rope, kv_cache, backend):
        h = self.norm(x, w.input_norm)
        x = x + self.attention(layer_id, w, h, step, rope, kv_cache, backend)
        h = self.norm(x, w.post_attn_norm)
        if w.moe is not None:
            return x + moe_forward(h, w.moe, self.routing, self.act)
        return x + gated_mlp(h, *w.mlp, self.act)

    def attention(self, layer_id, w: MLALayerWeights, h, step, rope, kv_cache, backend):
        """MLA of one layer: write the latent rows, then attend absorbed or expanded."""
        m, t = self.spec.mla, h.shape[0]
        q = linear(h, w.q) if w.q is not None else linear(self.norm(linear(h, w.q_a), w.q_a_norm), w.q_b)
        q_nope, q_pe = q.view(t, -1, m.qk_nope_head_dim + m.qk_rope_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = linear(h, w.kv_a).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        layer = kv_cache.layer(layer_id)
        group = step.groups[layer.group_index]
        cos, sin = rope.tables[("tok", False)]
        row = torch.cat((self.norm(latent, w.kv_a_norm), apply_rotary(k_pe[:, None], cos, sin)[:, 0]), -1)
        kv_cache.write(layer, row[:, None], None, group.slot_mapping)  # [T, 1, cache_dim]
        params = self.attention_params(layer_id, kv_cache)
        q_rot = apply_rotary(q_pe, cos, sin)
        if layer.sink_tokens or (group.decode is not None and self.force_path != "expanded"):
            sink = rope.tables.get(("sink", False, layer.group_index))
            q_sink = apply_rotary(q_pe, *sink) if sink is not None and layer.sink_tokens else None
            out = self._absorbed_paged(w, q_nope, q_rot, q_sink, layer, group, params, backend)
        else:
            out = self._per_sequence(w, q_nope, q_rot, layer, group, params)
        return linear(out.reshape(t, -1), w.o)

    def _absorbed_paged(self, w, q_nope, q_rot, q_sink, layer, group, params, backend):
        """Decode steps and sink mode: absorbed queries through the paged backend -> [T, H, dv]."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [T, H, r]
        sink_query = None if q_sink is None else torch.cat((q_lat, q_sink), -1)
        out = backend.forward(torch.cat((q_lat, q_rot), -1), sink_query, layer, group, params)
        return self._from_latent(w, out[..., :self.spec.mla.kv_lora_rank])

    def _from_latent(self, w, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [T, H, r] -> per-head values [T, H, dv]."""
        return torch.bmm(o_lat.transpose(0, 1), w.w_uv_t).transpose(0, 1)

    def _per_sequence(self, w, q_nope, q_rot, layer, group, params) -> torch.Tensor:
        """Prefill, chunks and mixed steps: each sequence absorbed or expanded, whichever the
        multiply-add count favours for its new tokens and keys -> [T, H, dv]."""
        m = self.spec.mla
        flat = layer.key.view(-1, m.cache_dim)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], m.v_head_dim)
        for s in group.sequences:
            part = slice(s.query_start, s.query_end)
            rows = flat.index_select(0, s.key_slots).to(q_nope.dtype)  # [keys, r + dr]
            if self._expands(s):
                out[part] = self._expanded(w, q_nope[part], q_rot[part], rows, s, params)
            else:
                q_lat = torch.bmm(q_nope[part].transpose(0, 1), w.w_uk).transpose(0, 1)
                o = attend_gathered(torch.cat((q_lat, q_rot[part]), -1), rows[:, None], rows[:, None],
                                    s, params)  # one KV head: query heads folded, no K/V copies
                out[part] = self._from_latent(w, o[..., :m.kv_lora_rank])
        return out

    def _expands(self, s) -> bool:
        if self.force_path is not None:
            return self.force_path == "expanded"
        return expansion_pays(self.spec.mla, s.query_end - s.query_start, s.key_slots.shape[0])

    def _expanded(self, w: MLALayerWeights, q_nope, q_rot, rows, s, params) -> torch.Tensor:
        """One sequence's attention [n, H, dv] over per-head keys and values expanded from
        its cached rows [keys, r + dr]."""
        m, heads = self.spec.mla, q_nope.shape[1]
        latent, k_pe = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_nope, v = linear(latent, w.kv_b).view(-1, heads, m.qk_nope_head_dim + m.v_head_dim).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), -1)  # [keys, H, dn + dr]
        # flash attention wants one head size: q, k and v are zero-padded to the larger of
        # dn + dr and dv (zeros add nothing to a score or a value), the output cut to dv
        width = max(k.shape[-1], m.v_head_dim)
        query = _padded(torch.cat((q_nope, q_rot), -1), width)
        att = attend_gathered(query, _padded(k, width), _padded(v, width), s, params)
        return att[..., :m.v_head_dim]


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] with zeros appended up to [..., width] (x itself when d == width)."""
    if x.shape[-1] == width:
        return x
    out = x.new_zeros(*x.shape[:-1], width)
    out[..., :x.shape[-1]] = x
    return out


def _check_supported(spec: ModelSpec) -> None:
    if spec.attention_bias:
        raise ConfigError(spec.source, "attention_bias", "true is not supported for DeepSeek "
                          "(MLA) models here; published DeepSeek-V2/V3 checkpoints have false")
    if spec.rope.partial_rotary_factor != 1.0:
        raise ConfigError(spec.source, "partial_rotary_factor",
                          "MLA rotates all qk_rope_head_dim dims; remove the field")
    if any(_is_moe_layer(spec, i) for i in range(spec.num_layers)):
        _check_routing(spec)


def _check_routing(spec: ModelSpec) -> None:
    """MoE fields that would otherwise fail deep inside a forward, named with the fix."""
    moe, src = spec.moe, spec.source
    experts, k = moe["n_routed_experts"], moe.get("num_experts_per_tok")
    if not k or k > experts:
        raise ConfigError(src, "num_experts_per_tok", f"must be in [1, n_routed_experts = "
                          f"{experts}] for the MoE layers, got {k}")
    grouped = spec.model_type == "deepseek_v3" or moe.get("topk_method") == "group_limited_greedy"
    groups, kept = moe.get("n_group"), moe.get("topk_group")
    if grouped and (not groups or experts % groups or not kept or kept > groups):
        raise ConfigError(src, "n_group", f"group-limited routing needs n_group dividing "
                          f"n_routed_experts ({experts}) and 1 <= topk_group <= n_group; got "
                          f"n_group {groups}, topk_group {kept}")
    if spec.model_type == "deepseek_v3" and experts // groups < 2:
        raise ConfigError(src, "n_group", f"V3 scores a group by its 2 best experts; "
                          f"{experts} experts in {groups} groups leave fewer than 2 per group")


def _mlp_names(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    h, p = spec.hidden_size, f"model.layers.{i}.mlp."
    if not _is_moe_layer(spec, i):
        inter = spec.intermediate_size
        return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h),
                p + "down_proj.weight": (h, inter)}
    moe, inter = spec.moe, spec.moe["moe_intermediate_size"]
    num_experts = moe["n_routed_experts"]
    out = {p + "gate.weight": (num_experts, h)}
    if spec.model_type == "deepseek_v3":
        out[p + "gate.e_score_correction_bias"] = (num_experts,)
    for e in range(num_experts):
        q = f"{p}experts.{e}."
        out.update({q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h),
                    q + "down_proj.weight": (h, inter)})
    shared = moe.get("n_shared_experts") or 0
    if shared:
        s = f"{p}shared_experts."
        out.update({s + "gate_proj.weight": (inter * shared, h), s + "up_proj.weight": (inter * shared, h),
                    s + "down_proj.weight": (h, inter * shared)})
    return out


def deinterleave_rows(w: torch.Tensor, start: int, size: int, every: int) -> torch.Tensor:
    """Reorder rows [start, start + size) of each `every`-row block: evens first, then odds.

    DeepSeek rotates pairs (0, 1), (2, 3) ...; after this, pair i is (i, i + size / 2),
    the half-split layout apply_rotary rotates, with the same frequency per pair.
    """
    blocks = w.reshape(-1, every, *w.shape[1:])
    rope = blocks[:, start:start + size]
    order = torch.cat((torch.arange(0, size, 2), torch.arange(1, size, 2)))
    blocks = torch.cat((blocks[:, :start], rope[:, order], blocks[:, start + size:]), dim=1)
    return blocks.reshape(w.shape)


def _load_layer(spec: ModelSpec, source, i: int, dtype: torch.dtype, weights: str) -> MLALayerWeights:
    m, heads, p = spec.mla, spec.num_attention_heads, f"model.layers.{i}."
    a = p + "self_attn."
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim

    def get(name):
        return source.get(name, dtype)

    def proj(name, rope_rows=None):  # rope_rows: (start, every) of the interleaved rope rows
        if rope_rows is not None and m.rope_interleave:  # reordered dense, then stored as asked
            w = deinterleave_rows(source.get(name, torch.float32), rope_rows[0], m.qk_rope_head_dim,
                                  rope_rows[1])
            return pack_linear(_stored_as(w, weights, dtype), dense_dtype=dtype)
        return pack_linear(source.get_linear(name, weights, dtype), dense_dtype=dtype)

    kv_b = get(a + "kv_b_proj.weight").view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    lora = bool(m.q_lora_rank)
    return MLALayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        q=None if lora else proj(a + "q_proj.weight", (m.qk_nope_head_dim, qk)),
        q_a=proj(a + "q_a_proj.weight") if lora else None,
        q_a_norm=get(a + "q_a_layernorm.weight") if lora else None,
        q_b=proj(a + "q_b_proj.weight", (m.qk_nope_head_dim, qk)) if lora else None,
        kv_a=proj(a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim)),
        kv_a_norm=get(a + "kv_a_layernorm.weight"),
        w_uk=kv_b[:, :m.qk_nope_head_dim].contiguous(),
        w_uv_t=kv_b[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous(),
        kv_b=pack_linear(kv_b.reshape(-1, m.kv_lora_rank).contiguous(), dense_dtype=dtype),
        o=proj(a + "o_proj.weight"),
        post_attn_norm=get(p + "post_attention_layernorm.weight"),
        mlp=None if _is_moe_layer(spec, i) else _gated(source, p + "mlp.", weights, dtype),
        moe=_load_moe(spec, source, p + "mlp.", weights, dtype) if _is_moe_layer(spec, i) else None)


def _stored_as(w: torch.Tensor, weights: str, dtype: torch.dtype):
    """A dense fp32 weight in the storage `weights` asks for (see WeightSource.get_linear)."""
    from ctxwarden.layers.quant import GROUP, Q4, Q8, quantize

    if weights in ("int4", "int8") and w.shape[-1] % GROUP == 0:
        return quantize(w, {"int4": Q4, "int8": Q8}[weights])
    return w.to(torch.bfloat16 if weights == "bf16" else (torch.float32 if weights == "fp32" else dtype))


def _gated(source, p: str, weights: str, dtype: torch.dtype) -> tuple[LinearWeight, LinearWeight]:
    parts = [source.get_linear(p + n, weights, dtype) for n in ("gate_proj.weight", "up_proj.weight")]
    down = source.get_linear(p + "down_proj.weight", weights, dtype)
    return pack_linear(stack_rows(parts), dense_dtype=dtype), pack_linear(down, dense_dtype=dtype)


def _load_moe(spec: ModelSpec, source, p: str, weights: str, dtype: torch.dtype) -> MoEWeights:
    num_experts = spec.moe["n_routed_experts"]
    bias_name = p + "gate.e_score_correction_bias"
    return MoEWeights(
        gate=source.get(p + "gate.weight", torch.float32),  # routing stays fp32, as trained
        score_bias=source.get(bias_name, torch.float32) if bias_name in source.infos else None,
        experts=[_gated(source, f"{p}experts.{e}.", weights, dtype) for e in range(num_experts)],
        shared=(_gated(source, p + "shared_experts.", weights, dtype)
                if spec.moe.get("n_shared_experts") else None))
