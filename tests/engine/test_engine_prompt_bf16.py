"""The engine with a bf16 KV cache, whose prompt rows attend in bf16 dot products.

With `prompt_attention="bf16"` (what "auto" takes with a bf16 cache on an AVX-512 BF16
build where bf16 measures faster) prompt rows' attention runs as bf16 Q K^T / P V and
generated rows' in fp32 (tests/runner/
test_prompt_attention.py). The engine's promises must hold as they do with one precision:
batching, chunking, pressure (swap or recompute) and prefix hits change no output. What
changes is sharing: a block holding generated tokens is never cached or hit, because the
same tokens as a prompt would make other KV (a next turn hits the last prompt's blocks).
"""

from __future__ import annotations

import random

import pytest

from ctxwarden.ext import kernels
from ctxwarden.llm import LLM
from ctxwarden.sampling import SamplingParams

ext = kernels()
pytestmark = pytest.mark.skipif(ext is None or not ext.has_bf16_attention(),
                                reason="bf16 prompt attention needs the AVX-512 BF16 build")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(tiny_dir, **kw):
    kw.setdefault("kv_memory", "8MiB")
    llm = LLM(str(tiny_dir), kv_dtype="bf16", prompt_attention="bf16", **kw)
    assert llm.engine.runner.prompt_attention == "bf16" and llm.engine.scheduler.prompt_blocks_only
    return llm


def test_chunking_and_batching_change_nothing(tiny_dir):
    prompts = _prompts(5, 60, 200, seed=1)
    whole = _llm(tiny_dir, max_batched_tokens=2048).generate(prompts, GREEDY)
    chunked = _llm(tiny_dir, max_batched_tokens=37).generate(prompts, GREEDY)
    alone_llm = _llm(tiny_dir)
    alone = [alone_llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked] == [o.token_ids for o in alone]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pressure_changes_nothing(tiny_dir, mode):
    prompts = _prompts(16, 40, 60, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    calm = _llm(tiny_dir, kv_memory="16MiB").generate(prompts, params)
    page = _llm(tiny_dir).engine.runner.layout.page_bytes
    tight = _llm(tiny_dir, kv_memory=4 * -(-(60 + 40) // 16) * page, preemption_mode=mode)
    pressed = tight.generate(prompts, params)
    stats = tight.engine.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert [o.token_ids for o in pressed] == [o.token_ids for o in calm]
    assert tight.engine.stats().kv.num_blocks_in_use == 0 and tight.engine.audit().is_clean


def test_a_next_turn_hits_the_prompt_blocks_only_and_answers_as_a_fresh_engine(tiny_dir):
    first = _prompts(1, 70, 70, seed=3)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # prompt_logprobs would read no cache
    warm = _llm(tiny_dir)
    answer = warm.generate([first], params)[0].token_ids
    second = first + list(answer) + [11, 12, 13, 14, 15]  # the conversation goes on
    again = warm.generate([second], params)[0]
    fresh = _llm(tiny_dir).generate([second], params)[0]
    assert again.num_cached_tokens == len(first) // 16 * 16  # not the 40 generated tokens
    assert again.token_ids == fresh.token_ids
    # with one precision for every row, the answer's blocks are shared as before
    one = LLM(str(tiny_dir), kv_memory="8MiB", kv_dtype="bf16", prompt_attention="fp32")
    assert not one.engine.scheduler.prompt_blocks_only
    one.generate([first], params)
    assert one.generate([second], params)[0].num_cached_tokens == (len(first) + 40) // 16 * 16


def test_sink_mode_prompt_rows_take_bf16_and_chunking_changes_nothing(tiny_dir, monkeypatch):
    import ctxwarden.runner.attention as attention

    calls = []

    class Counting:  # ext with prefill_attention's bf16 calls counted (the real kernel runs)
        def __getattr__(self, name):
            return getattr(ext, name)

        def prefill_attention(self, *args):
            calls.append(bool(args[9]) and args[8] > 0)  # bf16 dots with sink keys
            return ext.prefill_attention(*args)

    monkeypatch.setattr(attention, "kernels", lambda: Counting())
    prompts = _prompts(3, 100, 160, seed=4)
    sink = dict(window_tokens=40, sink_tokens=4)
    whole = _llm(tiny_dir, max_batched_tokens=2048, **sink).generate(prompts, GREEDY)
    chunked = _llm(tiny_dir, max_batched_tokens=37, **sink).generate(prompts, GREEDY)
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked]
    assert sum(calls) > 0  # later chunks read sinks through the bf16 kernel
