"""The engine with fp8 KV: preemption, the prefix cache and a KV tier work on fp8 pages.

fp8 pages are bytes (float8 codes + a scale byte per row) to everything outside attention,
and a token's bytes depend on that token alone (runner/kv_quant.py): so greedy output under
pressure, swapped or recomputed, and after a prefix hit or a tier fetch, must be exactly
the output of an unpressured, uncached fp8 run.
"""

from __future__ import annotations

import random

import pytest

from ctxwarden.llm import LLM
from ctxwarden.sampling import SamplingParams

FP8 = ("fp8_e4m3", "fp8_e5m2")


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _assert_clean(llm):
    assert llm.engine.stats().kv.num_blocks_in_use == 0
    report = llm.engine.audit()
    assert report.is_clean, report.findings


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_pressure_preempts_and_outputs_stay_identical(tiny_dir, mode, kv_dtype):
    prompts = _prompts(12, 40, 60, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    calm = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype=kv_dtype).generate(prompts, params)
    probe = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype=kv_dtype)
    per_seq_blocks = -(-(60 + 40) // 16)
    tight = LLM(str(tiny_dir), kv_memory=3 * per_seq_blocks * probe.engine.runner.layout.page_bytes,
                kv_dtype=kv_dtype, preemption_mode=mode, enable_prefix_caching=False)
    assert tight.engine.num_blocks == 3 * per_seq_blocks
    pressed = tight.generate(prompts, params)
    assert [o.token_ids for o in pressed] == [o.token_ids for o in calm]
    stats = tight.engine.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    _assert_clean(tight)


def test_fp8_prefix_hit_gives_the_uncached_output(tiny_dir):
    prompt = _prompts(1, 200, 200, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    # chunks end at the hit boundary (192 = 12 blocks), so both runs compute the same steps
    cold = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype="fp8_e4m3", max_batched_tokens=192,
               enable_prefix_caching=False).generate([prompt], params)[0]
    warm_llm = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype="fp8_e4m3", max_batched_tokens=192)
    first = warm_llm.generate([prompt], params)[0]
    again = warm_llm.generate([prompt], params)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 192)
    for out in (first, again):
        assert out.token_ids == cold.token_ids
        assert [t.logprob for t in out.logprobs] == [t.logprob for t in cold.logprobs]
    _assert_clean(warm_llm)


def test_fp8_pages_come_back_from_a_disk_tier_and_only_to_their_own_dtype(tiny_dir, tmp_path):
    """A disk tier written by an e4m3 engine serves a fresh e4m3 engine (bit-identical
    logprobs); an e5m2 or bf16 engine never reads those bytes (the namespace has the KV dtype)."""
    prompt = _prompts(1, 200, 200, seed=6)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    tiers = f"disk:{tmp_path}:64MiB"

    def run(kv_dtype):
        llm = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype=kv_dtype, max_batched_tokens=192,
                  kv_tiers=tiers, kv_tier_fetch="always")
        out = llm.generate([prompt], params)[0]
        assert llm.engine.tiers.flush(10)
        llm.engine.close()
        return out

    written = run("fp8_e4m3")
    fetched = run("fp8_e4m3")
    assert (written.num_cached_tokens, fetched.num_cached_tokens) == (0, 192)
    assert [t.logprob for t in fetched.logprobs] == [t.logprob for t in written.logprobs]
    assert run("fp8_e5m2").num_cached_tokens == 0
    assert run("bf16").num_cached_tokens == 0
