"""The runner's fast paths against plain references: packed linear, decode, chunk attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxwarden.layers.linear import can_pack, linear, pack_linear
from ctxwarden.runner.attention import (_FLASH_WITH_LSE, AttentionParams, _decode_one, _decode_sdpa,
                                        _eager, _prefix_then_causal)


@pytest.mark.parametrize("rows", [0, 1, 4, 17, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 40)
    packed = pack_linear(w)
    assert packed.is_packed == can_pack(w)
    assert torch.allclose(linear(x, packed), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert linear(x, packed).shape == (rows, 96)


def test_bf16_weights_of_a_bf16_model_are_packed_where_onednn_has_bf16():
    torch.manual_seed(2)
    w, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(5, 32)
    packed = pack_linear(w, dense_dtype=torch.bfloat16)
    assert packed.is_packed == can_pack(w, torch.bfloat16)
    got = linear(x, packed)  # fp32 in, fp32 out; the matmul itself in bf16
    assert got.dtype == torch.float32
    assert torch.allclose(got, F.linear(x.bfloat16(), w).float(), atol=2e-2, rtol=2e-2)


def _eager_reference(q, k, v, mask, scale):
    # q [B, Hq, D], k/v [B, M, Hkv, D], mask [B, M]
    params = AttentionParams(scale)
    return _eager(q[:, None], None, k, v, mask[:, None, :], None, params)[:, 0]


def test_batch_one_decode_matches_eager():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 16), torch.randn(1, 37, 2, 16), torch.randn(1, 37, 2, 16)
    mask = torch.ones(1, 37, dtype=torch.bool)
    mask[0, 30:] = False
    got = _decode_one(q[0], k[0], v[0], mask[0], AttentionParams(0.25))[None]
    assert torch.allclose(got, _eager_reference(q, k, v, mask, 0.25), atol=1e-6)


def test_batched_decode_sdpa_matches_eager_with_padding():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 6, 16), torch.randn(3, 20, 2, 16), torch.randn(3, 20, 2, 16)
    mask = torch.arange(20)[None, :] < torch.tensor([[5], [20], [11]])
    got = _decode_sdpa(q, k, v, mask, AttentionParams(0.25))
    assert torch.allclose(got, _eager_reference(q, k, v, mask, 0.25), atol=1e-6)


@pytest.mark.skipif(_FLASH_WITH_LSE is None, reason="this torch build has no flash-with-LSE op")
@pytest.mark.parametrize("num_cached", [1, 7, 64])
def test_prefix_then_causal_matches_masked_sdpa(num_cached):
    torch.manual_seed(num_cached)
    n, m = 13, 13 + num_cached
    q, k, v = torch.randn(n, 6, 16), torch.randn(m, 2, 16), torch.randn(m, 2, 16)
    mask = torch.arange(m - n, m)[:, None] >= torch.arange(m)[None, :]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, scale=0.3,
                                         enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(_prefix_then_causal(q, k, v, 0.3), ref, atol=1e-5)


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [49, 64, 130])
def test_fp32_prefill_gemm_matches_fp64_on_either_backend(monkeypatch, backend, rows):
    """Prefill-sized fp32 GEMMs take MKL or oneDNN (measured at first use); both are fp32
    products of the same weight, within fp32 rounding of the fp64 reference."""
    from ctxwarden.layers import linear as linear_module

    monkeypatch.setenv("CTXWARDEN_FP32_GEMM", backend)
    linear_module.fp32_gemm_backend.cache_clear()
    try:
        torch.manual_seed(rows)
        w, x = torch.randn(96, 576), torch.randn(rows, 576)
        expected = "onednn" if backend == "onednn" and torch.backends.mkldnn.is_available() else "mkl"
        assert linear_module.fp32_gemm_backend() == (expected, None)
        ref = F.linear(x.double(), w.double())
        for got in (linear(x, pack_linear(w)), linear_module.fp32_gemm(x, w),
                    linear(x[None], pack_linear(w))[0]):  # 3-D input: the general path
            assert got.dtype == torch.float32 and got.shape == (rows, 96)
            assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    finally:
        linear_module.fp32_gemm_backend.cache_clear()


def test_fp32_gemm_backend_refuses_an_unknown_name(monkeypatch):
    from ctxwarden.layers import linear as linear_module

    monkeypatch.setenv("CTXWARDEN_FP32_GEMM", "cublas")
    linear_module.fp32_gemm_backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="CTXWARDEN_FP32_GEMM must be 'mkl' or 'onednn', got 'cublas'"):
            linear_module.fp32_gemm_backend()
    finally:
        linear_module.fp32_gemm_backend.cache_clear()


def test_fp32_gemm_backend_measures_when_not_forced(monkeypatch):
    from ctxwarden.layers import linear as linear_module

    monkeypatch.delenv("CTXWARDEN_FP32_GEMM", raising=False)
    linear_module.fp32_gemm_backend.cache_clear()
    try:
        name, ratio = linear_module.fp32_gemm_backend()
        assert name in ("mkl", "onednn")
        if torch.backends.mkldnn.is_available():
            assert ratio > 0 and (name == "onednn") == (ratio > 1 / 0.9)
    finally:
        linear_module.fp32_gemm_backend.cache_clear()


def test_chunked_prefill_on_ext_flash_attention_matches_torch_sdpa(monkeypatch):
    """SmolLM2 prefilled in two chunks (the second over cached keys) with ext's flash
    attention and with torch's SDPA: the same logits within fp32 rounding, and not
    bit-identical (so the two really are different paths)."""
    from ctxwarden.ext import simd_level
    from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput
    from ctxwarden.runner import attention
    from ctxwarden.spec.checkpoint import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if simd_level() not in ("avx512", "avx2"):
        pytest.skip("ext's prefill attention needs a vector build (AVX-512 or AVX2)")
    runner = ModelRunner(None, RunnerConfig(num_blocks=24, block_size=16, weights="fp32"))
    ids = torch.randint(0, 40000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    tables = (tuple(range(24)),)
    results = []
    for use_ext in (True, False):
        monkeypatch.setattr(attention, "_PREFILL_KERNEL", use_ext)
        first = runner.forward(ForwardBatch((SequenceInput.chunk(ids[:200], 0, tables, "all"),)))
        second = runner.forward(ForwardBatch((SequenceInput.chunk(ids[200:], 200, tables, "all"),)))
        results.append(torch.cat([first, second]))
    assert (results[0] - results[1]).abs().max() < 1e-3  # 30 layers, a 49K vocabulary
    assert not torch.equal(results[0], results[1])
