"""Prompt rows in bf16 dot products, generated rows in fp32: a row's precision is its role.

`prompt_attention="bf16"` (the default "auto" with a bf16 KV cache on AVX-512 BF16) runs
ext's flash attention with bf16 Q K^T and P V for prompt rows only. What must hold:
- the kernel stays within its rounding bound of exact attention of the rounded query;
- a prompt row's result does not depend on how the prompt is chunked (bit-identical);
- a generated token recomputed in a prefill chunk (recompute after preemption) gets the
  fp32 result its decode step got, not the bf16 one (else the KV it rewrites would differ);
- a step of single tokens takes the decode path only when none is a prompt token.
"""

from __future__ import annotations

import pytest
import torch

from ctxwarden.ext import kernels
from ctxwarden.plan.kv import kv_layout
from ctxwarden.runner import ForwardBatch, SequenceInput
from ctxwarden.runner.inputs import build_step_inputs
from runner_parity import PageAllocator, make_runner, tables_for

ext = kernels()
needs_bf16 = pytest.mark.skipif(ext is None or not ext.has_bf16_attention(),
                                reason="bf16 prompt attention needs the AVX-512 BF16 build")
HAS_AMX = ext is not None and hasattr(ext, "has_amx_attention") and ext.has_amx_attention()


@pytest.fixture(params=["amx", "avx512"])
def tiles(request):
    """The bf16 kernel on AMX's tile units (where the CPU has them) and on AVX-512's."""
    if request.param == "amx" and not HAS_AMX:
        pytest.skip("no AMX-BF16 here (or the kernel refused the tiles)")
    old = ext.set_amx(request.param == "amx") if HAS_AMX else None
    yield request.param
    if old is not None:
        ext.set_amx(old)


def _reference(q, k, v, q0, window, q_sink=None, num_sink=0, k0=0):
    """fp64 causal (windowed) attention of q [n, Hq, D]: the first num_sink keys are sinks
    at positions 0.. scored against q_sink (visible to every later query), the rest at
    positions k0..; rows that see no key are zeros."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qp = torch.arange(q0, q0 + n)[:, None]
    kp = torch.cat([torch.arange(num_sink), torch.arange(k0, k0 + m - num_sink)])[None]
    ok = (kp <= qp) & ((qp - kp < window) if window else True)
    ok[:, :num_sink] = kp[:, :num_sink] <= qp
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), kk)
    if num_sink:
        s[..., :num_sink] = torch.einsum("nhd,mhd->hnm", q_sink.double(), kk[:num_sink])
    s = s.masked_fill(~ok[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1).nan_to_num(0.0), vv)


@needs_bf16
@pytest.mark.parametrize("n,m,hq,hkv,d,window", [
    (5, 5, 9, 3, 64, 0),         # a short prompt, SmolLM2's heads
    (300, 1300, 9, 3, 64, 0),    # a later chunk at an odd offset over cached keys
    (130, 201, 8, 2, 80, 37),    # a window (blocks start at an odd key), d = 5 x 16
    (1, 1, 2, 1, 16, 0),         # one token
])
def test_bf16_dots_stay_within_their_rounding_bound(n, m, hq, hkv, d, window, tiles):
    torch.manual_seed(n + m)
    q = torch.randn(n, hq, d) * 2  # scores spread over several units: a peaked softmax
    k, v = torch.randn(m, hkv, d).bfloat16(), torch.randn(m, hkv, d).bfloat16()
    scale, q0 = d ** -0.5, m - n
    got = ext.prefill_attention(q, k, v, q0, 0, window, scale, None, 0, True)
    # the kernel rounds q * scale and the softmax weights to bf16 (2^-9 relative each): the
    # weights' rounding moves the output by at most 2^-9 max|v|, twice that with the sum
    ref = _reference((q * scale).bfloat16(), k.float(), v.float(), q0, window)
    bound = 2.0 ** -8 * float(v.float().abs().max())
    assert (got.double() - ref).abs().max() < bound
    # fp32 pages holding the same values give the same bits (the runner gathers fp32 when a
    # chunk mixes prompt and generated rows)
    assert torch.equal(got, ext.prefill_attention(q, k.float(), v.float(), q0, 0, window, scale, None, 0, True))


@needs_bf16
def test_a_prompt_rows_bf16_result_does_not_depend_on_the_chunking(tiles):
    torch.manual_seed(3)
    q = torch.randn(700, 9, 64)
    k, v = torch.randn(700, 3, 64).bfloat16(), torch.randn(700, 3, 64).bfloat16()
    whole = ext.prefill_attention(q, k, v, 0, 0, 0, 0.125, None, 0, True)
    for cut in (1, 37, 64, 333):  # earlier rows see fewer keys: the same blocks, in order
        head = ext.prefill_attention(q[:cut].contiguous(), k[:cut].contiguous(), v[:cut].contiguous(),
                                     0, 0, 0, 0.125, None, 0, True)
        tail = ext.prefill_attention(q[cut:].contiguous(), k, v, cut, 0, 0, 0.125, None, 0, True)
        assert torch.equal(torch.cat((head, tail)), whole)


@pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 here (or the kernel refused the tiles)")
def test_amx_tiles_take_the_heads_they_can_and_switch_off():
    """AMX runs head sizes that are a multiple of 32 (a tile's 32 bf16 of Q); the two tile
    kinds sum in other orders, so they agree to the bound, not to the bit."""
    torch.manual_seed(5)
    q = torch.randn(100, 9, 64) * 2  # 300 rows: the last tile of 16 padded
    k, v = torch.randn(400, 3, 64).bfloat16(), torch.randn(400, 3, 64).bfloat16()
    on = ext.prefill_attention(q, k, v, 300, 0, 0, 0.125, None, 0, True)
    assert ext.set_amx(False) is True and not ext.has_amx_attention()
    try:
        off = ext.prefill_attention(q, k, v, 300, 0, 0, 0.125, None, 0, True)
    finally:
        ext.set_amx(True)
    assert ext.has_amx_attention()
    bound = 2.0 ** -8 * float(v.float().abs().max())
    assert 0 < (on - off).abs().max() < 2 * bound


@needs_bf16
@pytest.mark.parametrize("n,m,num_sink,q0,k0,window", [
    (64, 200, 4, 300, 104, 100),   # a chunk deep in a stream: 4 sinks + a window's keys
    (40, 40, 3, 0, 3, 16),         # the stream's first chunk, an odd count of sinks
    (70, 140, 101, 400, 331, 50),  # more sinks than a key block, odd again
])
def test_bf16_dots_with_sinks_stay_within_the_bound(n, m, num_sink, q0, k0, window, tiles):
    torch.manual_seed(n + num_sink)
    q, q_sink = torch.randn(n, 9, 64) * 2, torch.randn(n, 9, 64) * 2
    k, v = torch.randn(m, 3, 64).bfloat16(), torch.randn(m, 3, 64).bfloat16()
    got = ext.prefill_attention(q, k, v, q0, k0, window, 0.125, q_sink, num_sink, True)
    rounded = [(x * 0.125).bfloat16() for x in (q, q_sink)]
    ref = _reference(rounded[0], k.float(), v.float(), q0, window, rounded[1], num_sink, k0)
    assert (got.double() - ref).abs().max() < 2.0 ** -8 * float(v.float().abs().max())
    no_sinks = ext.prefill_attention(q, k, v, q0, k0, window, 0.125, q, num_sink, True)
    assert (no_sinks.double() - ref).abs().max() > 1e-2  # q_sink really scored the sinks


@needs_bf16
def test_bf16_dots_refuse_other_dtypes():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="bf16 too with bf16_dots"):
        ext.prefill_attention(q, k.half(), k.half(), 0, 0, 0, 0.2, None, 0, True)
    with pytest.raises(RuntimeError, match="fp32 k and v"):
        ext.prefill_attention(q, k.bfloat16(), k.bfloat16(), 0, 0, 0, 0.2)  # fp32 dots take fp32


@needs_bf16
def test_generated_tokens_recomputed_in_a_chunk_get_their_decode_steps_fp32_result(tiny_model):
    model = tiny_model("llama")
    prompt = [(i * 37) % 500 + 3 for i in range(90)]
    P, D = len(prompt), 12

    def run():
        runner = make_runner(model, 16, P + D + 16, kv_dtype="bf16", prompt_attention="bf16")
        assert runner.prompt_attention == "bf16" and runner.prompt_rows_apart
        return runner, tables_for(runner, PageAllocator(runner.config.num_blocks), P + D + 1)

    # first pass: the prompt as one chunk, then D decode steps
    runner, tables = run()
    prefill = runner.forward(ForwardBatch((SequenceInput.chunk(prompt, 0, tables, "all", P),)))
    tokens, decode = list(prompt), []
    for _ in range(D):
        tokens.append(int((decode[-1] if decode else prefill[-1]).argmax()))
        step = SequenceInput.chunk(tokens[-1:], len(tokens) - 1, tables, "last", P)
        decode.append(runner.forward(ForwardBatch((step,)))[0])

    # recompute: prompt and generated tokens in one chunk, as after a preemption
    def recompute(num_prompt_tokens):
        runner, tables = run()
        seq = SequenceInput.chunk(tokens, 0, tables, "all", num_prompt_tokens)
        return runner.forward(ForwardBatch((seq,)))

    again = recompute(P)
    assert (again[:P] - prefill).abs().max() < 1e-5  # prompt rows: bf16 both times
    # row P + i of the chunk is generated token i at position P + i, as in decode step i
    gen_err = float((again[P:] - torch.stack(decode)).abs().max())
    assert gen_err < 1e-5  # fp32 both times: summation order only
    # the test can fail: the same rows taken as prompt rows (bf16) move by far more
    as_prompt = recompute(P + D)
    assert (as_prompt[P:] - torch.stack(decode)).abs().max() > 20 * max(gen_err, 1e-6)


def test_a_single_token_step_with_a_prompt_token_leaves_the_decode_path(tiny_model):
    from ctxwarden.spec.checkpoint import resolve_checkpoint

    layout = kv_layout(resolve_checkpoint(tiny_model("llama")).spec, "bf16", 16)
    tables = ((0, 1, 2),)
    generated = SequenceInput.chunk([7], 20, tables, "last", 20)  # position 20, prompt of 20
    tail = SequenceInput.chunk([8], 19, tables, "last", 20)  # a prompt's last token after a hit
    both = ForwardBatch((generated, tail))
    assert build_step_inputs(ForwardBatch((generated,)), layout, 8, True).groups[0].decode is not None
    assert build_step_inputs(both, layout, 8, True).groups[0].decode is None
    assert build_step_inputs(both, layout, 8, False).groups[0].decode is not None
    seq = build_step_inputs(both, layout, 8, True).groups[0].sequences
    assert [s.num_prompt_rows for s in seq] == [0, 1]


def test_auto_takes_bf16_only_with_a_bf16_cache_and_a_model_the_kernel_runs(tiny_model):
    import dataclasses

    from ctxwarden.runner import RunnerConfig
    from ctxwarden.runner.model_runner import prompt_attention_speed, resolve_prompt_attention
    from ctxwarden.spec.checkpoint import resolve_checkpoint

    spec = resolve_checkpoint(tiny_model("llama")).spec
    capped = dataclasses.replace(spec, attn_logit_softcapping=50.0)
    config = lambda **kw: RunnerConfig(num_blocks=4, **kw)  # noqa: E731
    assert resolve_prompt_attention(config(kv_dtype="fp32"), spec) == "fp32"
    assert resolve_prompt_attention(config(kv_dtype="bf16", prompt_attention="fp32"), spec) == "fp32"
    assert resolve_prompt_attention(config(kv_dtype="bf16"), capped) == "fp32"
    with pytest.raises(ValueError, match="prompt_attention='bf16' needs .* dtype fp32 \\(got bf16\\)"):
        resolve_prompt_attention(config(kv_dtype="bf16", dtype="bf16", prompt_attention="bf16"), spec)
    with pytest.raises(ValueError, match="prompt_attention must be one of auto, bf16, fp32, got 'half'"):
        config(prompt_attention="half")
    if ext is not None and ext.has_bf16_attention():
        # auto takes bf16 where it measured faster than fp32 here, and explicit bf16 anywhere
        choice, speed = prompt_attention_speed(spec.head_dim)
        assert speed > 0 and choice == ("bf16" if speed > 1 / 0.9 else "fp32")
        assert resolve_prompt_attention(config(kv_dtype="bf16"), spec) == choice
        assert resolve_prompt_attention(config(kv_dtype="fp32", prompt_attention="bf16"), spec) == "bf16"
