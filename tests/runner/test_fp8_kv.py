"""fp8 KV: float8 codes with a power-of-two scale per (token, KV head), in the pages.

What is pinned here: the rows round-trip within the format's own precision; the pool is
what the planner plans (scales counted) and about half of bf16; the runner reading fp8
pages in prefill, chunked prefill and decode is off transformers in fp32 by what its
rounding step predicts relative to bf16 KV; the quality on the real SmolLM2 (passkey,
perplexity) is in test_fp8_kv_quality.py.
"""

from __future__ import annotations

import pytest
import torch

from ctxwarden.plan import kv_bytes_per_token, plan_memory
from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput
from ctxwarden.runner.kv_quant import FP8_TORCH_DTYPES, dequantize_rows, quantize_rows
from ctxwarden.spec.checkpoint import resolve_checkpoint
from runner_parity import PageAllocator, hf_model, hf_reference, make_runner, prompt_ids, tables_for

FP8 = tuple(FP8_TORCH_DTYPES)
MANTISSA_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}
MIN_SUBNORMAL = {"fp8_e4m3": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}
MiB = 1024 ** 2


@pytest.mark.parametrize("kv_dtype", FP8)
def test_rows_round_trip_within_the_formats_precision(kv_dtype):
    """Round to nearest: at most half a step, 2^-(m+1) relative in the normal range and half
    the smallest subnormal (times the row's scale) below it; amax lands in (max/2, max]."""
    fp8 = FP8_TORCH_DTYPES[kv_dtype]
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 4, 300)[:, None, None]  # rows from 1e-6 to 1e4
    x = torch.randn(300, 3, 64, generator=g) * magnitudes
    x[0, 0] = 0.0  # an all-zero row
    rows = quantize_rows(x, fp8)
    assert rows.dtype == torch.uint8 and rows.shape == (300, 3, 65)
    y = dequantize_rows(rows, fp8)
    exponent = rows[..., -1:].to(torch.int32) - 127
    scale = torch.ldexp(torch.ones(exponent.shape), exponent)
    bound = torch.maximum(x.abs() * 2.0 ** -(MANTISSA_BITS[kv_dtype] + 1),
                          scale * MIN_SUBNORMAL[kv_dtype] / 2)
    assert ((y - x).abs() <= bound).all()
    codes = rows[..., :-1].contiguous().view(fp8).float().abs().amax(-1)
    fmax = torch.finfo(fp8).max
    assert ((codes >= fmax / 2) & (codes <= fmax))[1:].all() and (y[0, 0] == 0).all()


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("arch,options", [("llama", {}), ("gemma3", dict(num_layers=6, sliding_window=24))])
def test_fp8_pool_is_planned_with_its_scales_and_half_of_bf16(tiny_model, arch, options, kv_dtype):
    ckpt = resolve_checkpoint(tiny_model(arch, **options))
    spec = ckpt.spec
    plan = plan_memory(spec, memory_bytes=ckpt.weights_bytes + 3 * MiB, weights_bytes=ckpt.weights_bytes,
                       weights_source="safetensors header", kv_dtype=kv_dtype, block_size=16,
                       activation_reserve_bytes=0)
    runner = ModelRunner(ckpt, RunnerConfig(num_blocks=plan.num_blocks, block_size=16, kv_dtype=kv_dtype))
    assert runner.kv_cache.nbytes == plan.kv_pool_bytes > 0
    assert all(t.shape == (plan.num_blocks, 16, spec.num_kv_heads, spec.head_dim + 1)
               for t in runner.kv_cache.keys + runner.kv_cache.values)
    # per token and layer: K and V of each KV head, D codes + 1 scale byte (bf16: 2 D bytes)
    assert kv_bytes_per_token(spec, kv_dtype) == spec.num_layers * 2 * spec.num_kv_heads * (spec.head_dim + 1)
    assert kv_bytes_per_token(spec, kv_dtype) / kv_bytes_per_token(spec, "bf16") == (spec.head_dim + 1) / (2 * spec.head_dim)


def _teacher_forced_diff(runner, prompt, ref, chunk=None) -> float:
    """Max |logit diff| against `ref` over every prompt row (prefilled in chunks of `chunk`)
    and 32 decode steps fed the reference's own tokens: a near-tie that rounding flips
    would otherwise send the two decodes down different texts."""
    tables = tables_for(runner, PageAllocator(runner.config.num_blocks), len(prompt) + 33)
    chunk = chunk or len(prompt)
    rows = [runner.forward(ForwardBatch((SequenceInput.chunk(prompt[s:s + chunk], s, tables, "all"),)))
            for s in range(0, len(prompt), chunk)]
    diff = (torch.cat(rows) - ref.prefill_logits).abs().max().item()
    for i, (token, expected) in enumerate(zip(ref.tokens, ref.decode_logits)):
        out = runner.forward(ForwardBatch((SequenceInput.chunk([token], len(prompt) + i, tables),)))[0]
        diff = max(diff, (out - expected).abs().max().item())
    return diff


# Rounding K/V moves the logits about in proportion to the rounding step while the step is
# small: e4m3's relative step (3 mantissa bits) is 16x bf16's (7 bits), e5m2's 32x. fp8's
# error against transformers in fp32 must stay within twice that multiple of bf16 KV's own
# error on the same prompt (the 2 for the spread of a maximum over ~13K logits; measured
# multiples 12-18 for e4m3, 20-50 for e5m2 over llama, qwen3, gemma2 and gemma3), and above
# bf16's (it does round coarser). A wrong scale or a clipped range is off by far more.
STEP_MULTIPLE = {"fp8_e4m3": 16, "fp8_e5m2": 32}
_REFERENCES = {}  # model dir -> transformers' logits on the 100-token prompt


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("arch,options,chunk", [
    ("llama", {}, None), ("llama", {}, 33), ("qwen3", dict(head_dim=32), None),
    ("gemma3", dict(num_layers=6, sliding_window=24), 40)])
def test_fp8_error_scales_with_its_rounding_step(tiny_model, arch, options, chunk, kv_dtype):
    model_dir = tiny_model(arch, **options)
    prompt = prompt_ids(100, 512)
    ref = _REFERENCES.get(model_dir) or _REFERENCES.setdefault(
        model_dir, hf_reference(hf_model(model_dir), prompt, 32))
    bf16 = _teacher_forced_diff(make_runner(model_dir, 16, 133, kv_dtype="bf16"), prompt, ref, chunk)
    fp8 = _teacher_forced_diff(make_runner(model_dir, 16, 133, kv_dtype=kv_dtype), prompt, ref, chunk)
    assert bf16 < fp8 < 2 * STEP_MULTIPLE[kv_dtype] * bf16, f"bf16 {bf16:.2e}, {kv_dtype} {fp8:.2e}"
