"""ext/kernels.cpp against plain torch references: quantized linear, decode attention, fused ops.

Every test here needs the built extension (`make install` builds it); without it they skip,
and the rest of the suite runs the plain-torch fallbacks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ctxwarden.diagnostics.environment import read_cpu
from ctxwarden.ext import has_vector_kernels, kernels
from ctxwarden.layers import linear as linear_module
from ctxwarden.layers.linear import (QDENSE_NEVER, codes_of, decode_kernel, dense_one_stream, dense_weight, linear,
                                     pack_linear, qdense_min_rows, unpack_q4_panels)
from ctxwarden.layers.norm import rms_norm
from ctxwarden.layers.quant import Q4, Q8, dequantize, from_gguf_blocks, quantize
from ctxwarden.layers.rotary import apply_rotary
from ctxwarden.runner.attention import AttentionParams, _eager

ext = kernels()
pytestmark = pytest.mark.skipif(ext is None, reason="ext/ kernels not built (make install builds them)")


@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 47, 48, 200])
def test_quantized_linear_equals_the_dequantized_weight(kind, rows):
    torch.manual_seed(rows)
    w, x = torch.randn(77, 96) * 0.1, torch.randn(rows, 96)
    q = quantize(w, kind)
    got = linear(x, pack_linear(q))  # kernel below DENSE_MIN_ROWS, dense GEMM above
    ref = F.linear(x, dequantize(q))
    tol = 1e-4  # the kernel below DENSE_MIN_ROWS and the fp32 dense GEMM above it alike
    assert got.shape == (rows, 77)
    assert (got - ref).abs().max().item() < tol * ref.abs().max().item()


@pytest.mark.parametrize("k", [43, 96, 576])  # 43: a tail past every vector width
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 13, 48])
def test_dense_fp32_kernel_matches_f_linear(k, rows):
    torch.manual_seed(k + rows)
    w, x = torch.randn(97, k), torch.randn(rows, k)  # 97: a row count past every tile
    lw = pack_linear(w)
    assert lw.dense_kernel == (ext.simd_level() != "none")  # plain fp32 takes the kernel
    got = linear(x, lw)
    ref = F.linear(x.double(), w.double()).float()
    assert got.shape == (rows, 97)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ext.dense_linear(x, w), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [43, 96, 576])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 13, 48, 49, 300])
def test_bf16_weight_is_multiplied_in_fp32_at_every_step_size(k, rows):
    """bf16 storage, fp32 compute: the kernel (up to 48 rows) and the widened weight's GEMM
    (above) both give the bf16-rounded weight's fp32 product, not a bf16 matmul's."""
    torch.manual_seed(k * rows + 1)
    w, x = torch.randn(97, k).bfloat16(), torch.randn(rows, k)
    lw = pack_linear(w)
    assert lw.dense_kernel == (ext.simd_level() != "none") and not lw.is_packed
    ref = F.linear(x.double(), w.double()).float()
    got = linear(x, lw)
    assert got.dtype == torch.float32 and got.shape == (rows, 97)
    if rows == 0:
        return
    # fp32 summation over K, in whatever order the GEMM blocks it: within K * 2^-24 of
    # sum |x w| per output (the textbook bound; measured: ~1% of it on oneDNN, AVX2
    # Zen 1, where a bound of 1e-6 x max |ref| was just missed). A bf16 product (x rounded
    # to 8 bits of mantissa) is up to 14x over it at K = 576, 300 rows (measured).
    bound = k * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T).float()
    assert ((got - ref).abs() <= bound).all()
    if rows <= 48:
        assert ((ext.dense_linear(x, w) - ref).abs() <= bound).all()
    bf16_matmul = F.linear(x.bfloat16(), w).float()  # what a bf16 GEMM gives: far coarser
    assert (bf16_matmul - ref).abs().max() > 100 * (got - ref).abs().max()


def _rounded_per_group(x: torch.Tensor) -> torch.Tensor:
    """x with each group of 32 rounded as the int8-activation kernels round it."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127)).reshape(x.shape)


# K = 96 (3 groups: one pair and an odd one), 288 (9: one block of 8 and an odd one),
# 576 (18: two blocks, one pair); rows across the 4 x 2 tile and the 64-row passes
@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("k", [96, 288, 576])
@pytest.mark.parametrize("rows", [1, 3, 65])
def test_int8_activation_kernel_is_the_dequantized_weight_on_rounded_activations(kind, k, rows):
    torch.manual_seed(k + rows)
    w, x = torch.randn(37, k) * 0.1, torch.randn(rows, k)
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
    q = quantize(w, kind)
    got = ext.quantized_linear_int8(x, q.codes, q.scale, q.zero)
    ref = F.linear(_rounded_per_group(x), dequantize(q))
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    # and the rounding costs what it should: ~0.5% of the output, far from a broken kernel
    exact = F.linear(x, dequantize(q))
    assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("kind", [Q4, Q8])
@pytest.mark.parametrize("k", [64, 96, 288, 576])
def test_int8_activation_rows_do_not_depend_on_their_batch(kind, k):
    """What makes chunking, batching and recompute reproduce each other in auto-int8act.
    q4 from 16 rows up runs as a GEMM over 16-weight-row panels (203: a part panel of 11),
    below that as 4 x 2 tiles (203: three weight rows left to the one-row tiles); K = 64 /
    96 / 288 / 576 give 2 / 3 / 9 / 18 groups (tail groups after the blocks of 8: 2, 3, 1
    and 2, which take three different tail paths in the tiles). Every row must come out
    bit for bit the same from either kernel."""
    torch.manual_seed(1)
    q = quantize(torch.randn(203, k) * 0.1, kind)
    x = torch.randn(130, k)
    x[7, 3] = 40.0  # an outlier: its group's scale is large
    whole = ext.quantized_linear_int8(x, q.codes, q.scale, q.zero)
    for lo, hi in ((0, 1), (5, 6), (3, 10), (0, 15), (0, 16), (2, 19), (64, 130), (129, 130)):
        assert torch.equal(ext.quantized_linear_int8(x[lo:hi].contiguous(), q.codes, q.scale, q.zero),
                           whole[lo:hi]), (lo, hi)
    previous = ext.set_i8_gemm_min_rows(10**9)  # the tiles at every row count
    try:
        assert torch.equal(ext.quantized_linear_int8(x, q.codes, q.scale, q.zero), whole)
    finally:
        ext.set_i8_gemm_min_rows(previous)
    if ext.has_panels():  # AVX-512 VNNI: the panel tiles at every row count
        panels = ext.q4_panels(q.codes, q.scale, q.zero) if kind == Q4 else ext.q8_panels(q.codes, q.scale)
        # q4: the same bytes as codes, scales, zeros; q8: and -128 sum(w) per group (int32)
        assert panels.shape == (13, k // 32 * (320 if kind == Q4 else 608))
        for lo, hi in ((0, 130), (0, 1), (5, 7), (3, 10), (0, 16), (2, 19), (64, 130), (129, 130)):
            assert torch.equal(ext.quantized_linear_int8(x[lo:hi].contiguous(), q.codes, q.scale, q.zero, panels),
                               whole[lo:hi]), (lo, hi)


@pytest.mark.skipif(ext is None or not ext.has_panels(), reason="panels need the AVX-512 VNNI build")
def test_q4_panels_replace_the_row_major_codes():
    """A q4 weight with int8 activations keeps one copy of its codes, in the panels: the
    row-major codes unpack from them exactly, and every path gives the codes' numbers."""
    q = replace(quantize(torch.randn(40, 96), Q4), int8_activations=True)  # 40 rows: a padded last panel
    w = pack_linear(q)
    assert w.quant.codes.numel() == 0 and w.quant.shape == (40, 96) and w.weight is w.panels
    assert w.nbytes == w.panels.nbytes + q.scale.nbytes + q.zero.nbytes
    assert torch.equal(unpack_q4_panels(w.panels, 40, 96), q.codes)
    assert torch.equal(codes_of(w).codes, q.codes)
    assert torch.equal(dense_weight(w), dequantize(q))
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, 96)
        assert torch.equal(linear(x, w), ext.quantized_linear_int8(x, q.codes, q.scale, q.zero))
    mode, tensors = decode_kernel(w)
    assert mode == 6 and tensors[0] is w.panels
    q8 = pack_linear(replace(quantize(torch.randn(40, 96), Q8), int8_activations=True))
    assert q8.quant.codes.shape == (40, 96)  # q8 keeps its codes (a tied lm_head's embedding reads them)


@pytest.mark.skipif(ext is None or not ext.has_panels(), reason="panels need the AVX-512 VNNI build")
def test_panels_of_another_weight_are_refused():
    q = quantize(torch.randn(40, 96), Q4)
    other = quantize(torch.randn(40, 64), Q4)
    x = torch.randn(3, 96)
    with pytest.raises(RuntimeError, match=r"q4 panels must be q4_panels' uint8 \[ceil\(N / 16\), K / 32 \* 320\]"):
        ext.quantized_linear_int8(x, q.codes, q.scale, q.zero, ext.q4_panels(other.codes, other.scale, other.zero))
    q8, other8 = quantize(torch.randn(40, 96), Q8), quantize(torch.randn(24, 96), Q8)
    with pytest.raises(RuntimeError, match=r"q8 panels must be q8_panels' uint8 \[ceil\(N / 16\), K / 32 \* 608\]"):
        ext.quantized_linear_int8(x, q8.codes, q8.scale, None, ext.q8_panels(other8.codes, other8.scale))


@pytest.mark.parametrize("kind", [Q4, Q8])
def test_fp32_activation_rows_do_not_depend_on_their_batch(kind):
    """q4 / q8 with fp32 activations below DENSE_MIN_ROWS: from 8 rows up (AVX-512) a block
    of weight rows is dequantized once and multiplied by the dense tile, below that each
    tile dequantizes its own; both give every row bit-identical results."""
    torch.manual_seed(2)
    q = quantize(torch.randn(203, 576) * 0.1, kind)  # 203: a tail past the 4-row block
    x = torch.randn(47, 576)

    def run(rows):
        return (ext.q4_linear(rows, q.codes, q.scale, q.zero) if kind == Q4
                else ext.q8_linear(rows, q.codes, q.scale))

    whole = run(x)
    for lo, hi in ((0, 1), (5, 6), (3, 7), (2, 10), (8, 24), (30, 47)):
        assert torch.equal(run(x[lo:hi].contiguous()), whole[lo:hi]), (lo, hi)
    ref = F.linear(x.double(), dequantize(q).double())
    assert (whole - ref).abs().max() < 1e-5 * ref.abs().max()


def test_quantize_stays_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    groups = w.reshape(16, 2, 32)
    steps = {Q4: (groups.amax(-1) - groups.amin(-1)) / 15,  # min..max in 16 levels
             Q8: groups.abs().amax(-1) / 127}  # symmetric: -127..127 times absmax / 127
    for kind, step in steps.items():
        err = (dequantize(quantize(w, kind)) - w).reshape(16, 2, 32).abs().amax(-1)
        assert (err <= step * 0.51 + 1e-3).all(), kind


def test_gguf_q4_1_and_q8_0_codes_dequantize_like_gguf():
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for name in ("Q4_1", "Q4_0", "Q8_0"):
        raw = gguf_quantize(w, T[name])
        ours = dequantize(from_gguf_blocks(raw.reshape(-1).view(np.uint8), name, (8, 64)))
        theirs = torch.from_numpy(gguf_dequantize(raw, T[name]).reshape(8, 64))
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,sinks", [(None, 0), (5.0, 0), (None, 3)])
def test_paged_decode_attention_matches_eager(pool_dtype, softcap, sinks):
    torch.manual_seed(3)
    blocks, bs, hkv, d, hq = 12, 4, 2, 16, 6
    k_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    v_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    num_keys = torch.tensor([5, 17, 9])
    slots = torch.zeros(3, 17, dtype=torch.long)
    for b, n in enumerate(num_keys.tolist()):
        slots[b, :n] = torch.randperm(blocks * bs)[:n]
    q, q_sink = torch.randn(3, hq, d), torch.randn(3, hq, d)
    num_sink = torch.clamp(num_keys, max=sinks)
    params = AttentionParams(0.25, softcap)
    got = ext.paged_decode_attention(q, q_sink if sinks else None, k_pool, v_pool, slots,
                                     num_keys, num_sink, 0.25, softcap or 0.0)
    flat_k, flat_v = k_pool.view(-1, hkv, d).float(), v_pool.view(-1, hkv, d).float()
    mask = torch.arange(17)[None, :] < num_keys[:, None]
    sink_keys = (torch.arange(17)[None, :] < num_sink[:, None])[:, None, None, None, :]
    ref = _eager(q[:, None], q_sink[:, None] if sinks else None, flat_k[slots], flat_v[slots],
                 mask[:, None], sink_keys, params)[:, 0]
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_over_hundreds_of_keys_with_a_wide_score_range(pool_dtype):
    # SmolLM2's shape (head_dim 64, 3 query heads per KV head) and enough keys for the
    # vectorized exp; scale 2.0 spreads scores over ~100 nats, so many e^x underflow
    torch.manual_seed(5)
    blocks, bs, hkv, d, hq, width = 40, 16, 2, 64, 6, 500
    k_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    v_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    num_keys = torch.tensor([width, 37, 301])
    slots = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(num_keys.tolist()):
        slots[b, :n] = torch.randperm(blocks * bs)[:n]
    q = torch.randn(3, hq, d)
    got = ext.paged_decode_attention(q, None, k_pool, v_pool, slots, num_keys,
                                     torch.zeros(3, dtype=torch.long), 2.0, 0.0)
    flat_k, flat_v = k_pool.view(-1, hkv, d).float(), v_pool.view(-1, hkv, d).float()
    mask = torch.arange(width)[None, :] < num_keys[:, None]
    ref = _eager(q[:, None], None, flat_k[slots], flat_v[slots], mask[:, None], None,
                 AttentionParams(2.0, None))[:, 0]
    assert torch.allclose(got, ref, atol=1e-5)


def test_the_build_uses_the_vector_instructions_this_cpu_has():
    # without a vector path the quantized linears run scalar loops, 7.5-13x slower than a
    # dense fp32 matvec at one row (measured on an AVX2-only EPYC before it had one)
    flags = {f for f, present in read_cpu()["flags"].items() if present}
    if not flags:
        pytest.skip("no CPU flags readable (no /proc/cpuinfo)")
    expected = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "none"
    assert ext.simd_level() == expected


def test_fused_norm_rope_write_and_silu_match_torch():
    torch.manual_seed(4)
    t, hq, hkv, d = 3, 4, 2, 8
    x, delta, w = torch.randn(t, 32), torch.randn(t, 32), torch.randn(32)
    assert torch.allclose(ext.rms_norm(x, w, 1e-5, 0.0), rms_norm(x, w, 1e-5), atol=1e-5)
    assert torch.allclose(ext.rms_norm(x, w, 1e-5, 1.0), rms_norm(x, w, 1e-5, 1.0), atol=1e-5)
    x2 = x.clone()
    assert torch.allclose(ext.add_rms_norm(x2, delta, w, 1e-5, 0.0), rms_norm(x + delta, w, 1e-5), atol=1e-5)
    assert torch.equal(x2, x + delta)
    gu = torch.randn(t, 20)
    assert torch.allclose(ext.silu_mul(gu), F.silu(gu[:, :10]) * gu[:, 10:], atol=1e-6)
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    angles = torch.randn(t, d // 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    k_pool, v_pool = torch.zeros(5, 2, hkv, d), torch.zeros(5, 2, hkv, d)
    slots = torch.tensor([7, 0, 4])
    q = ext.rope_write_kv(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv, d)
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], -1)
    assert torch.allclose(q, apply_rotary(qr.reshape(t, hq, d), cos, sin), atol=1e-6)
    assert torch.allclose(k_pool.view(-1, hkv, d)[slots], apply_rotary(kr.reshape(t, hkv, d), cos, sin), atol=1e-6)
    assert torch.equal(v_pool.view(-1, hkv, d)[slots], vr.reshape(t, hkv, d))


def test_fused_ops_at_prefill_rows_match_torch_and_do_not_depend_on_the_split():
    """A prefill's rows are split across threads (more than 64 rows) and silu_mul runs 16
    lanes at a time with a scalar tail: each row equals the same op on that row alone, and
    silu stays within a few ulp of float64 over a wide range of gates (+-90, 0, tiny)."""
    torch.manual_seed(5)
    t, hidden, inter, hq, hkv, d = 300, 96, 16 * 9 + 5, 3, 1, 32
    gu = torch.randn(t, 2 * inter) * 8
    gu[0, :6] = torch.tensor([90.0, -90.0, 0.0, -0.0, 1e-30, -1e-30])
    out = ext.silu_mul(gu)
    ref = F.silu(gu[:, :inter].double()) * gu[:, inter:].double()
    assert ((out.double() - ref).abs() <= 4e-6 * ref.abs() + 1e-30).all()
    assert torch.equal(torch.cat([ext.silu_mul(gu[i:i + 1].contiguous()) for i in range(t)]), out)
    x, delta, w = torch.randn(t, hidden), torch.randn(t, hidden), torch.randn(hidden)
    normed = ext.rms_norm(x, w, 1e-5, 0.0)
    assert torch.allclose(normed, rms_norm(x, w, 1e-5), atol=1e-5)
    assert torch.equal(torch.cat([ext.rms_norm(x[i:i + 1].contiguous(), w, 1e-5, 0.0) for i in range(t)]), normed)
    x2 = x.clone()
    added = ext.add_rms_norm(x2, delta, w, 1e-5, 0.0)
    assert torch.equal(x2, x + delta) and torch.equal(added, ext.rms_norm(x + delta, w, 1e-5, 0.0))
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    angles = torch.randn(t, d // 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    k_pool, v_pool = torch.zeros(t + 20, hkv, d), torch.zeros(t + 20, hkv, d)
    slots = torch.randperm(t + 20)[:t]
    q = ext.rope_write_kv(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv, d)
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], -1)
    assert torch.allclose(q, apply_rotary(qr.reshape(t, hq, d), cos, sin), atol=1e-5)
    assert torch.allclose(k_pool[slots], apply_rotary(kr.reshape(t, hkv, d), cos, sin), atol=1e-5)
    assert torch.equal(v_pool[slots], vr.reshape(t, hkv, d))
    untouched = torch.ones(t + 20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@pytest.mark.parametrize("weights", ["fp32", "bf16", "auto", "int8", "auto-int8act"])
def test_whole_step_and_layer_calls_are_bit_identical_to_the_python_calls(weights):
    """ext's one-call paths against the same layers as ~10 calls each from Python, on
    SmolLM2's weights in each projection mode: a batched decode step through DecodeStack
    (every layer in one call and one parallel region), through decode_layer (one call per
    layer), and through the Python calls gives the same logits and KV pages exactly (same
    kernels, same order), and each path is the one taken."""
    from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput
    from ctxwarden.spec.checkpoint import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    runner = ModelRunner(None, RunnerConfig(num_blocks=12, weights=weights))
    model, g = runner.model, torch.Generator().manual_seed(3)
    tables = [(tuple(range(4 * s, 4 * s + 4)),) for s in range(3)]
    lengths = [5, 40, 17]
    for n, t in zip(lengths, tables):
        runner.forward(ForwardBatch((SequenceInput.chunk(torch.randint(0, 40000, (n,), generator=g).tolist(), 0, t),)))
    step = ForwardBatch(tuple(SequenceInput.chunk([77 + i], n, t) for i, (n, t) in enumerate(zip(lengths, tables))))
    pools = [p.clone() for p in runner.kv_cache._tensors()]
    whole_step, whole_args = model._whole_step, model._whole_layer_args
    steps, layers = [], []
    record_step = lambda *a: steps.append(whole_step(*a)) or steps[-1]  # noqa: E731
    model._whole_step = record_step
    model._whole_layer_args = lambda *a: layers.append(whole_args(*a)) or layers[-1]
    results = []
    for path in ("stack", "layer", "python"):
        for p, saved in zip(runner.kv_cache._tensors(), pools):
            p.copy_(saved)
        if path == "layer":
            model._whole_step = lambda *a: None
        if path == "python":
            model._whole_layer_args = lambda *a: None
        results.append((runner.forward(step), [p.clone() for p in runner.kv_cache._tensors()]))
    assert len(steps) == 1 and steps[0] is not None
    assert steps[0][0].num_layers == model.spec.num_layers
    assert len(layers) == model.spec.num_layers and all(a is not None for a in layers)
    if weights == "auto-int8act" and ext.has_panels():  # every q4 projection runs from its panels
        assert all(lw.panels is not None and decode_kernel(lw)[0] == 6
                   for layer in model.layers for lw in (layer.qkv, layer.o, layer.gate_up, layer.down))
    if weights == "auto-int8act":  # three rows take the tiles; the GEMM from one row must match
        model._whole_step, model._whole_layer_args = record_step, whole_args
        previous = ext.set_i8_gemm_min_rows(1)
        try:
            for p, saved in zip(runner.kv_cache._tensors(), pools):
                p.copy_(saved)
            results.append((runner.forward(step), [p.clone() for p in runner.kv_cache._tensors()]))
        finally:
            ext.set_i8_gemm_min_rows(previous)
        assert len(steps) == 2 and steps[1] is not None
    for logits, kv in results[1:]:
        assert torch.equal(results[0][0], logits)
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], kv))
    assert not torch.equal(results[0][1][0], pools[0])  # the step wrote its keys


def _attention_reference(q, k, v, q0, k0, window, scale, q_sink=None, num_sink=0):
    """fp64 softmax attention under the runner's masking rule: the first num_sink keys are
    sinks at positions 0.. scored against q_sink, the rest at k0..; rows that see no key
    are zeros."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qp = torch.arange(q0, q0 + n)[:, None]
    kp = torch.cat([torch.arange(num_sink), torch.arange(k0, k0 + m - num_sink)])[None]
    ok = (kp <= qp) & ((qp - kp < window) if window else torch.ones_like(kp, dtype=torch.bool))
    ok[:, :num_sink] = kp[:, :num_sink] <= qp
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), kk) * scale
    if num_sink:
        scores[..., :num_sink] = torch.einsum("nhd,mhd->hnm", q_sink.double(), kk[:num_sink]) * scale
    p = torch.softmax(scores.masked_fill(~ok[None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, vv).float()


@pytest.mark.parametrize("n,m,hq,hkv,d,q0,k0,window", [
    (5, 5, 9, 3, 64, 0, 0, 0),          # a short prompt, SmolLM2's heads
    (100, 300, 9, 3, 64, 200, 0, 0),    # a later chunk over cached keys
    (77, 77, 4, 4, 32, 0, 0, 0),        # MHA, a tail past every tile
    (130, 200, 8, 2, 128, 70, 0, 50),   # a sliding window inside the chunk
    (50, 120, 6, 3, 80, 100, 30, 20),   # keys from a window's first kept block; d = 5 x 16
    (3, 1000, 6, 2, 64, 997, 0, 0),     # a few queries over many keys
    (1, 1, 2, 1, 16, 0, 0, 0),          # one token
])
def test_prefill_flash_attention_matches_softmax_attention(n, m, hq, hkv, d, q0, k0, window):
    if ext.simd_level() == "none":
        pytest.skip("prefill_attention needs a vector build")
    torch.manual_seed(n + m)
    q, k, v = torch.randn(n, hq, d), torch.randn(m, hkv, d), torch.randn(m, hkv, d)
    got = ext.prefill_attention(q, k, v, q0, k0, window, d ** -0.5)
    ref = _attention_reference(q, k, v, q0, k0, window, d ** -0.5)
    assert got.shape == (n, hq, d)
    assert (got - ref).abs().max() < 1e-5  # measured <= 1.3e-6
    if window == 0 and q0 == m - n and k0 == 0:  # what torch's SDPA computes, for the record
        sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], scale=d ** -0.5, enable_gqa=True,
                                              attn_mask=(torch.arange(m)[None] <= torch.arange(q0, q0 + n)[:, None]))
        assert (got - sdpa[0].transpose(0, 1)).abs().max() < 1e-5


@pytest.mark.parametrize("n,m,num_sink,q0,k0,window", [
    (64, 200, 4, 300, 104, 100),   # a chunk deep in a stream: 4 sinks + a window's keys
    (40, 40, 4, 0, 4, 16),         # the stream's first chunk: the sinks are its first keys
    (2, 3, 3, 0, 3, 8),            # only sinks so far
    (70, 140, 100, 400, 330, 50),  # more sinks than a key block
])
def test_prefill_flash_attention_with_sinks(n, m, num_sink, q0, k0, window):
    if ext.simd_level() == "none":
        pytest.skip("prefill_attention needs a vector build")
    torch.manual_seed(n + num_sink)
    q, q_sink = torch.randn(n, 9, 64), torch.randn(n, 9, 64)
    k, v = torch.randn(m, 3, 64), torch.randn(m, 3, 64)
    got = ext.prefill_attention(q, k, v, q0, k0, window, 0.125, q_sink, num_sink)
    ref = _attention_reference(q, k, v, q0, k0, window, 0.125, q_sink, num_sink)
    assert (got - ref).abs().max() < 1e-5
    no_sinks = ext.prefill_attention(q, k, v, q0, k0, window, 0.125, q, num_sink)
    assert (no_sinks - ref).abs().max() > 1e-3  # q_sink really scored the sinks


def test_prefill_flash_attention_refuses_what_it_cannot_run():
    q, k = torch.randn(4, 2, 20), torch.randn(4, 1, 20)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        ext.prefill_attention(q, k, k.clone(), 0, 0, 0, 0.2)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.prefill_attention(q[..., :16].bfloat16(), k[..., :16], k[..., :16], 0, 0, 0, 0.2)
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="sink keys need q_sink"):
        ext.prefill_attention(q, k, k.clone(), 0, 0, 0, 0.2, None, 2)


@pytest.mark.skipif(not has_vector_kernels(), reason="the scalar build has one q4/q8 path")
@pytest.mark.parametrize("kind", [Q4, Q8])
def test_the_panel_and_the_per_tile_path_give_the_same_bits(kind):
    """qdense_min_rows picks between the two by speed alone: that is only sound while a
    block of weight rows dequantized once (the panel) and every tile dequantizing its own
    produce the same bits at every row count."""
    torch.manual_seed(3)
    q = quantize(torch.randn(203, 576) * 0.1, kind)
    x = torch.randn(47, 576)

    def run(rows):
        return (ext.q4_linear(rows, q.codes, q.scale, q.zero) if kind == Q4
                else ext.q8_linear(rows, q.codes, q.scale))

    before = ext.set_qdense_min_rows(1)
    try:
        panel = {m: run(x[:m].contiguous()) for m in (1, 3, 8, 16, 47)}
        ext.set_qdense_min_rows(QDENSE_NEVER)
        for m, want in panel.items():
            assert torch.equal(run(x[:m].contiguous()), want), m
    finally:
        ext.set_qdense_min_rows(before)


def test_qdense_choice_is_timed_once_and_set_in_the_ext(monkeypatch):
    rows, speed = qdense_min_rows()
    if not has_vector_kernels():
        assert (rows, speed) == (QDENSE_NEVER, None)
        return
    assert rows in (8, 16, QDENSE_NEVER) and set(speed) == {8, 16}
    assert all(0.2 < s < 5 for s in speed.values()), speed  # a timing, not a constant
    current = ext.set_qdense_min_rows(rows)
    assert current == rows  # what the kernels run with now is what was chosen
    monkeypatch.setenv("CTXWARDEN_QDENSE_MIN_ROWS", "sixteen")
    qdense_min_rows.cache_clear()
    try:
        with pytest.raises(ValueError, match="CTXWARDEN_QDENSE_MIN_ROWS must be a row count"):
            qdense_min_rows()
        monkeypatch.setenv("CTXWARDEN_QDENSE_MIN_ROWS", "0")
        qdense_min_rows.cache_clear()
        assert qdense_min_rows() == (QDENSE_NEVER, None)
        assert ext.set_qdense_min_rows(rows) == QDENSE_NEVER
    finally:
        qdense_min_rows.cache_clear()
        monkeypatch.delenv("CTXWARDEN_QDENSE_MIN_ROWS")
        qdense_min_rows()  # timed again and set for the tests after this one


def test_load_module_refuses_to_time_the_loaded_build_in_place_of_another(tmp_path):
    """A second build of the kernels in a process that holds one comes back as the one
    already loaded (same soname), so an A/B in one process would time a build against
    itself: load_module says so instead of returning it."""
    import shutil

    from ctxwarden.ext import load_module

    copy = tmp_path / "other" / Path(ext.__file__).name
    copy.parent.mkdir()
    shutil.copy(ext.__file__, copy)
    with pytest.raises(RuntimeError, match="already loaded"):
        load_module(copy)
    assert load_module(Path(ext.__file__)) is ext


@pytest.mark.skipif(not has_vector_kernels(), reason="the scalar build has one dense order")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_gives_the_same_bits_one_row_at_a_time_or_side_by_side(dtype):
    """dense_one_stream picks between reading a weight one row at a time and several rows
    side by side by speed alone: sound only while both give every output the same bits,
    and the same bits as that row inside a batch (a row's result never depends on its
    batch)."""
    torch.manual_seed(5)
    w = (torch.randn(203, 576) * 0.05).to(dtype)  # 203: a tail past any tile width
    x = torch.randn(9, 576)
    before = ext.set_dense_one_stream(True)
    try:
        one = [ext.dense_linear(x[i:i + 1].contiguous(), w) for i in range(len(x))]
        ext.set_dense_one_stream(False)
        side = [ext.dense_linear(x[i:i + 1].contiguous(), w) for i in range(len(x))]
        batch = ext.dense_linear(x, w)
    finally:
        ext.set_dense_one_stream(before)
    for i in range(len(x)):
        assert torch.equal(one[i], side[i]), i
        assert torch.equal(one[i][0], batch[i]), i


def test_dense_order_is_timed_once_and_set_in_the_ext(monkeypatch):
    monkeypatch.setattr(linear_module, "_dense_choice", [])
    one_stream, speed = dense_one_stream()
    if not has_vector_kernels():
        assert (one_stream, speed) == (False, None)
        return
    assert 0.2 < speed < 5, speed  # a timing, not a constant
    assert one_stream == (speed > 1)
    assert ext.set_dense_one_stream(one_stream) == one_stream  # the kernels run with what was chosen
    assert dense_one_stream(torch.bfloat16) == (one_stream, speed)  # once per process, whatever the dtype
    monkeypatch.setattr(linear_module, "_dense_choice", [])
    monkeypatch.setenv("CTXWARDEN_DENSE_ONE_STREAM", "yes")
    try:
        with pytest.raises(ValueError, match="CTXWARDEN_DENSE_ONE_STREAM must be 1"):
            dense_one_stream()
        monkeypatch.setattr(linear_module, "_dense_choice", [])
        monkeypatch.setenv("CTXWARDEN_DENSE_ONE_STREAM", "0")
        assert dense_one_stream() == (False, None)
        assert ext.set_dense_one_stream(one_stream) is False
    finally:
        ext.set_dense_one_stream(one_stream)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,sinks", [(None, 0), (5.0, 4)])
def test_paged_decode_attention_splits_long_sequences_into_chunks_thread_count_free(pool_dtype, softcap, sinks):
    """Past 1,024 keys a sequence's keys are split into fixed chunks whose softmax partials
    are merged (ext's kDecodeChunk): the result matches eager attention, sinks and softcap
    included, and its bits do not depend on how many threads shared the chunks."""
    torch.manual_seed(7)
    blocks, bs, hkv, d, hq, width = 200, 16, 3, 64, 9, 3100
    k_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    v_pool = torch.randn(blocks, bs, hkv, d).to(pool_dtype)
    num_keys = torch.tensor([3100, 1024, 1025, 40])  # 4 chunks (a short last one), 1, 2 (one key), 1
    slots = torch.zeros(4, width, dtype=torch.long)
    for b, n in enumerate(num_keys.tolist()):
        slots[b, :n] = torch.randperm(blocks * bs)[:n]
    q, q_sink = torch.randn(4, hq, d), torch.randn(4, hq, d)
    num_sink = torch.clamp(num_keys, max=sinks)

    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return ext.paged_decode_attention(q, q_sink if sinks else None, k_pool, v_pool, slots, num_keys,
                                              num_sink, 0.5, softcap or 0.0)
        finally:
            torch.set_num_threads(before)

    got = run(2)
    assert torch.equal(run(1), got)
    flat_k, flat_v = k_pool.view(-1, hkv, d).float(), v_pool.view(-1, hkv, d).float()
    mask = torch.arange(width)[None, :] < num_keys[:, None]
    sink_keys = (torch.arange(width)[None, :] < num_sink[:, None])[:, None, None, None, :]
    ref = _eager(q[:, None], q_sink[:, None] if sinks else None, flat_k[slots], flat_v[slots],
                 mask[:, None], sink_keys if sinks else None, AttentionParams(0.5, softcap))[:, 0]
    assert torch.allclose(got, ref, atol=2e-5)
    # a sequence of at most one chunk is computed as it was alone: its bits do not change
    # with the other sequences of the step
    alone = ext.paged_decode_attention(q[1:2].contiguous(), q_sink[1:2].contiguous() if sinks else None, k_pool,
                                       v_pool, slots[1:2].contiguous(), num_keys[1:2], num_sink[1:2], 0.5,
                                       softcap or 0.0)
    assert torch.equal(alone[0], got[1])
