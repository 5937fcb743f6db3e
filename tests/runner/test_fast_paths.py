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
