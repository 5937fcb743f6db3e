"""Paged attention behind one interface, so a faster backend can replace this one.

`TorchPagedAttention` is the reference backend: gather the keys a query may read from the
pool through its block table, then attend densely. Two paths (costs in
docs/attention-backends.md):

- decode (every sequence has one new token): one padded gather [B, M]; one sequence takes
  two strided GQA bmm (q grouped per KV head: SDPA's single-query path is many times
  slower there, bf16 worst of all), several take one SDPA call (a fused kernel beats a
  batch of tiny matmuls); soft-capping or sinks take the eager matmul;
- prefill / chunks / mixed batches: per sequence, over the gathered keys, ext's fp32 flash
  attention (`prefill_attention`, AVX-512 builds: 2.2-2.3x torch's flash attention on a
  Zen 5 EPYC at 2,048-4,096 causal tokens), else SDPA with an explicit mask (is_causal
  when the chunk starts the sequence), or an eager matmul in query blocks when the layer
  needs what neither can do (logit soft-capping, sink re-positioning).

Masking rule for a query at position p and a key at position k:
    k <= p  and  (window is None  or  p - k < window  or  k < sink_tokens)
Sink keys are scored against the query rotated at min(p, sinks + window - 1) (StreamingLLM).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ctxwarden.ext import kernels, simd_level
from ctxwarden.runner.inputs import DecodeKeys, GroupInputs, SequenceKeys
from ctxwarden.runner.kv_cache import LayerKV
from ctxwarden.runner.kv_quant import Fp8Rows

_EAGER_QUERY_BLOCK = 256  # query rows per eager block: bounds scores to 256 x keys x heads
# Batch-1 decode over at most this many keys runs its small ops on one thread: each op
# that enters the thread pool costs ~50 us of wake-up under OMP_WAIT_POLICY=PASSIVE, more
# than the op (150 keys: 318 -> 59 us per layer; at 2048 keys two threads win again).
_ONE_THREAD_MAX_KEYS = 1024
# Flash attention that also returns the log-sum-exp (a private ATen op of CPU builds);
# without it, chunks after the first take the masked SDPA path.
# Pools ext/'s decode kernel reads in place (fp16 and fp8 pages are gathered, then converted).
IN_PLACE_POOL_DTYPES = (torch.float32, torch.bfloat16)
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class AttentionParams:
    """What a layer adds to the masking rule: scale, soft-cap, window, sinks."""

    scale: float
    softcap: float | None = None
    window_tokens: int | None = None
    sink_tokens: int = 0


class AttentionBackend:
    """Interface: attend new queries [T, Hq, D] over a layer's paged keys -> [T, Hq, D]."""

    name = "abstract"

    def forward(self, q: torch.Tensor, q_sink: torch.Tensor | None, kv: LayerKV,
                group: GroupInputs, params: AttentionParams) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Gather + SDPA for prefill, gather + GQA matmul for decode (see module docstring).

    `prompt_bf16`: prompt rows that ext's flash attention runs (sinks too; not soft-capping)
    take its bf16 dot products (`bf16_dots`); generated rows keep fp32 on every path, so a
    row's precision follows its role, never its step (docs/runner.md).
    """

    name = "torch"

    def __init__(self, prompt_bf16: bool = False):
        self.prompt_bf16 = prompt_bf16

    def forward(self, q, q_sink, kv, group, params):
        """Attention output [T, Hq, D] for the step's queries, in the batch's row order."""
        if (group.decode is not None and kv.fp8_dtype is None and q.dtype == torch.float32
                and kv.key.dtype in IN_PLACE_POOL_DTYPES and kernels() is not None):
            return _decode_in_place(q, q_sink, kv, group.decode, params)
        flat_k = kv.key.view(-1, *kv.key.shape[2:])  # [slots, Hkv, D]
        flat_v = kv.value.view(-1, *kv.value.shape[2:])
        if kv.fp8_dtype is not None:  # gathers dequantize the rows they read
            flat_k, flat_v = Fp8Rows(flat_k, kv.fp8_dtype), Fp8Rows(flat_v, kv.fp8_dtype)
        if group.decode is not None:
            return _decode(q, q_sink, flat_k, flat_v, group.decode, params)
        out = torch.empty_like(q)
        for s in group.sequences:
            rows = slice(s.query_start, s.query_end)
            qs = None if q_sink is None else q_sink[rows]
            out[rows] = _prefill_one(q[rows], qs, flat_k, flat_v, s, params, self.prompt_bf16)
        return out


def _decode_in_place(q, q_sink, kv: LayerKV, dk: DecodeKeys, params: AttentionParams):
    """Decode attention by ext/kernels.cpp, reading each key and value row in its page.

    No gather, no padding mask, one call per layer instead of ~10 ops; each (sequence,
    KV head) computes its query group's softmax over exactly its own keys.
    """
    qs = None if q_sink is None else q_sink.float().contiguous()
    return kernels().paged_decode_attention(q.contiguous(), qs, kv.key, kv.value, dk.key_slots,
                                            dk.num_keys, dk.num_sink_keys, params.scale,
                                            params.softcap or 0.0)


def _gather(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` (any shape) of the flat pool [slots, Hkv, D] as one dense tensor."""
    # index_select, not flat[slots]: advanced indexing is 10-1000x slower here (its
    # parallel kernel stalls on the shared cores), index_select is a plain row copy.
    rows = flat.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *flat.shape[1:]).to(dtype)


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """Boolean mask [..., n, m] of the masking rule for query/key positions."""
    dist = q_pos[..., :, None] - k_pos[..., None, :]
    ok = dist >= 0
    if params.window_tokens is not None:
        in_window = dist < params.window_tokens
        if params.sink_tokens:
            in_window = in_window | (k_pos[..., None, :] < params.sink_tokens)
        ok = ok & in_window
    return ok


def _prefill_one(q, q_sink, flat_k, flat_v, s: SequenceKeys, params: AttentionParams, prompt_bf16: bool = False):
    n = q.shape[0]
    n_prompt = s.num_prompt_rows if prompt_bf16 else 0
    # bf16 pages stay bf16 when every row takes bf16 dot products (half the bytes gathered)
    kv_dtype = torch.bfloat16 if n_prompt == n and flat_k.dtype == torch.bfloat16 else q.dtype
    k = _gather(flat_k, s.key_slots, kv_dtype)  # [m, Hkv, D]
    v = _gather(flat_v, s.key_slots, kv_dtype)
    ranges = _prefill_kernel_keys(q, k, s, params)
    if ranges is None and k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if ranges is not None:
        k0, num_sink = ranges
        qs = None if not num_sink else (q if q_sink is None else q_sink).float().contiguous()

        def flash(rows: slice, bf16: bool) -> torch.Tensor:
            return kernels().prefill_attention(q[rows].contiguous(), k, v, s.num_computed_tokens + rows.start, k0,
                                               params.window_tokens or 0, params.scale,
                                               None if qs is None else qs[rows].contiguous(), num_sink, bf16)
        if n_prompt in (0, n):
            return flash(slice(0, n), n_prompt == n)
        return torch.cat((flash(slice(0, n_prompt), True), flash(slice(n_prompt, n), False)))
    if params.softcap is None and q_sink is None:
        return _sdpa(q, k, v, s, params)
    if params.softcap is None and _FLASH_WITH_LSE is not None:
        return _sinks_and_window(q, q_sink, k, v, s, params)
    outs = []
    for start in range(0, q.shape[0], _EAGER_QUERY_BLOCK):
        rows = slice(start, start + _EAGER_QUERY_BLOCK)
        mask = _allowed(s.query_positions[rows], s.key_positions, params)  # [n, m]
        qs = None if q_sink is None else q_sink[rows]
        sink_keys = (s.key_positions < params.sink_tokens).view(1, 1, 1, 1, -1)
        outs.append(_eager(q[rows][None], qs if qs is None else qs[None], k[None], v[None],
                           mask[None], sink_keys, params)[0])
    return torch.cat(outs)


def _prefill_kernel_keys(q, k, s: SequenceKeys, params: AttentionParams) -> tuple[int, int] | None:
    """(first non-sink key position, number of sink keys) when ext's flash attention runs
    this chunk, else None. It runs fp32 chunks on a vector build (AVX-512 or AVX2: 2.2x
    and 1.3-1.9x torch's flash attention, measured) whose queries sit at consecutive positions from
    num_computed_tokens and whose keys are the leading sinks (positions 0..) then
    consecutive positions (the window's tail of the sequence), without soft-capping.
    CTXWARDEN_PREFILL_ATTENTION=torch keeps torch's paths (for A/B runs)."""
    m, d = k.shape[0], k.shape[-1]
    if not (_PREFILL_KERNEL and params.softcap is None and q.dtype == torch.float32 and m > 0
            and d % 16 == 0 and d <= 512 and kernels() is not None and simd_level() in ("avx512", "avx2")
            and int(s.query_positions[0]) == s.num_computed_tokens):
        return None
    num_sink = int((s.key_positions < params.sink_tokens).sum()) if params.sink_tokens else 0
    if num_sink and int(s.key_positions[num_sink - 1]) != num_sink - 1:
        return None
    if num_sink == m:
        return 0, num_sink
    first, last = int(s.key_positions[num_sink]), int(s.key_positions[-1])
    return (first, num_sink) if last - first == m - num_sink - 1 else None


_PREFILL_KERNEL = os.environ.get("CTXWARDEN_PREFILL_ATTENTION", "ext").strip().lower() != "torch"


def attend_gathered(q, k, v, s: SequenceKeys, params: AttentionParams) -> torch.Tensor:
    """One sequence's queries [n, Hq, D] over keys/values [m, Hkv, D] it already holds
    (gathered or computed by the caller): the prefill rule and kernels of this backend,
    without sinks or soft-capping. Used by MLA (models/deepseek.py).

    With one KV head (MQA, MLA's latent rows) the Hq query heads are folded into Hq * n
    rows of one head: one SDPA call with the [n, m] mask repeated per head, where the
    flash path would first copy K and V Hq times (2,048 keys of 576 values: 75 MB).
    """
    n, hq, d = q.shape
    if k.shape[1] == 1 and hq > 1:
        mask = _allowed(s.query_positions, s.key_positions, params).repeat(hq, 1)  # [Hq n, m]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).reshape(1, 1, hq * n, d), k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=params.scale)
        return out.view(hq, n, -1).transpose(0, 1)  # [n, Hq, Dv]
    return _sdpa(q, k, v, s, params)


def _sdpa(q, k, v, s: SequenceKeys, params: AttentionParams):
    n, m = q.shape[0], k.shape[0]
    # A chunk that starts the sequence with no window cut is plain causal attention: no
    # mask tensor at all. A later chunk with every earlier key visible is split in two
    # unmasked calls (see _prefix_then_causal). Otherwise an explicit [n, m] mask.
    no_cut = (params.window_tokens or m) >= m
    if s.num_computed_tokens == 0 and n == m and no_cut:
        mask, causal = None, True
    elif n < m == s.num_computed_tokens + n and no_cut and _FLASH_WITH_LSE is not None:
        return _prefix_then_causal(q, k, v, params.scale)
    else:
        mask, causal = _allowed(s.query_positions, s.key_positions, params), False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=params.scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def _prefix_then_causal(q, k, v, scale: float):
    """A chunk after cached keys: all of the prefix, then causal over its own keys.

    Two unmasked flash calls merged by their log-sum-exps: exactly softmax over the union.
    The masked call reads an [n, m] mask and cannot skip work; measured with SmolLM2 heads,
    2048 queries over 4096 keys 162 -> 102 ms, over 8192 keys 311 -> 249 ms.
    """
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # no GQA flag on this op
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    out_prefix, lse_prefix = _FLASH_WITH_LSE(qh, kh[:, :, :m - n], vh[:, :, :m - n], scale=scale)[:2]
    out_own, lse_own = _FLASH_WITH_LSE(qh, kh[:, :, m - n:], vh[:, :, m - n:], is_causal=True,
                                       scale=scale)[:2]
    top = torch.maximum(lse_prefix, lse_own)[..., None]  # [1, Hq, n, 1]
    w_prefix, w_own = torch.exp(lse_prefix[..., None] - top), torch.exp(lse_own[..., None] - top)
    out = (out_prefix.float() * w_prefix + out_own.float() * w_own) / (w_prefix + w_own)
    return out[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def _sinks_and_window(q, q_sink, k, v, s: SequenceKeys, params: AttentionParams):
    """Sink mode without the eager path: two flash calls merged by their log-sum-exps.

    The sink keys (leading positions < sink_tokens) are scored against q_sink, the other
    keys against q under the window + causal mask; softmax over the union is exactly the
    two partial softmaxes weighted by exp(lse). The eager path materialised scores for
    every query block (2.5x the time of plain sliding-window attention at 12K tokens).
    """
    allowed = _allowed(s.query_positions, s.key_positions, params)  # [n, m]
    num_sinks = int((s.key_positions < params.sink_tokens).sum())  # sinks lead (ascending)
    parts = []
    for qx, keys in ((q_sink, slice(0, num_sinks)), (q, slice(num_sinks, None))):
        mask = allowed[:, keys]
        if mask.shape[1] == 0:
            continue
        out, lse = _flash_masked(qx, k[keys], v[keys], mask, params.scale)
        parts.append((out, torch.where(mask.any(-1)[:, None], lse, float("-inf"))))  # [n,Hq,D], [n,Hq]
    top = torch.stack([lse for _, lse in parts]).amax(0)
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(o.float() * w for (o, _), w in zip(parts, weights))
    return (total / sum(weights)).to(q.dtype)


def _flash_masked(q, k, v, mask, scale: float):
    """Flash attention with an additive mask: q [n, Hq, D], k/v [m, Hkv, D], mask [n, m]
    bool -> out [n, Hq, D], lse [n, Hq] (a row with no allowed key gives out 0, lse 0)."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # no GQA flag on this op
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = _FLASH_WITH_LSE(qh, kh, vh, attn_mask=additive[None, None], scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _eager(q, q_sink, k, v, mask, sink_keys, params: AttentionParams):
    """Dense attention with GQA grouping. q [B, n, Hq, D], k/v [B, m, Hkv, D], mask [B, n, m]."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    kt = k.permute(0, 2, 3, 1)  # [B, Hkv, D, m]
    scores = _grouped(q, b, n, hkv, group, d) @ kt[:, :, None]  # [B, Hkv, G, n, m]
    if q_sink is not None:
        sink_scores = _grouped(q_sink, b, n, hkv, group, d) @ kt[:, :, None]
        scores = torch.where(sink_keys, sink_scores, scores)  # sink_keys [B, 1, 1, 1, m]
    scores = scores * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = probs @ v.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, G, n, D]
    return out.reshape(b, hq, n, d).transpose(1, 2)  # [B, n, Hq, D]


def _grouped(q, b, n, hkv, group, d):
    # [B, n, Hq, D] -> [B, Hkv, G, n, D]: query heads that share a KV head side by side
    return q.reshape(b, n, hkv, group, d).permute(0, 2, 3, 1, 4)


def _decode(q, q_sink, flat_k, flat_v, dk: DecodeKeys, params: AttentionParams):
    fast = q_sink is None and params.softcap is None
    if fast and q.shape[0] == 1:
        small = dk.key_slots.shape[1] <= _ONE_THREAD_MAX_KEYS
        with _threads(1 if small else torch.get_num_threads()):
            k, v, mask = _decode_gather(q, flat_k, flat_v, dk, params)
            return _decode_one(q[0], k[0], v[0], mask[0], params)[None]
    k, v, mask = _decode_gather(q, flat_k, flat_v, dk, params)
    if fast and q.dtype == torch.float32:  # SDPA's decode is pathological in bf16 (PERF-NOTES)
        return _decode_sdpa(q, k, v, mask, params)
    sink_keys = None
    if q_sink is not None:
        sink_keys = (dk.key_positions < params.sink_tokens)[:, None, None, None, :]  # [B,1,1,1,M]
    out = _eager(q[:, None], None if q_sink is None else q_sink[:, None], k, v, mask[:, None],
                 sink_keys, params)
    return out[:, 0]  # [B, Hq, D]


def _decode_gather(q, flat_k, flat_v, dk: DecodeKeys, params: AttentionParams):
    """Keys/values [B, M, Hkv, D] of a decode step and the mask [B, M] of which may be read."""
    k = _gather(flat_k, dk.key_slots, q.dtype)
    v = _gather(flat_v, dk.key_slots, q.dtype)
    mask = _allowed(dk.query_positions[:, None], dk.key_positions, params)[:, 0] & dk.is_valid
    return k, v, mask


@contextmanager
def _threads(num_threads: int):
    """Run the block with `num_threads` intra-op threads, then restore (switching is ~free)."""
    before = torch.get_num_threads()
    if num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _decode_one(q, k, v, mask, params: AttentionParams):
    """One sequence's decode: q [Hq, D], k/v [M, Hkv, D] -> [Hq, D] with two strided bmm.

    The permuted k/v views are BLAS-compatible (unit stride in one of their last two dims),
    so nothing is copied; at 8K keys this is ~6x faster than SDPA's single-query path.
    """
    hkv, d = k.shape[1], k.shape[2]
    qg = q.view(hkv, -1, d) * params.scale  # [Hkv, G, D]: query heads grouped per KV head
    scores = torch.bmm(qg, k.permute(1, 2, 0))  # [Hkv, G, M]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.bmm(probs, v.transpose(0, 1)).view(q.shape)  # [Hkv, G, D] -> [Hq, D]


def _decode_sdpa(q, k, v, mask, params: AttentionParams):
    """Batched decode: one SDPA call over the padded gather (transposed views, no copies).

    With many sequences one fused call beats a loop of small matmuls (each wakes the
    thread pool): 16 sequences x 256 keys 0.96 ms vs 3.5 ms for the grouped matmul.
    """
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=params.scale, enable_gqa=True)  # [B, Hq, 1, D]
    return out[:, :, 0]
