"""The engine on a tiny checkpoint: batching, chunking, pressure, release, refusal."""

from __future__ import annotations

import random

import pytest

from ctxwarden.errors import ContextLengthExceeded, KVCapacityExceeded, TokenizerError
from ctxwarden.llm import LLM
from ctxwarden.request import FinishReason
from ctxwarden.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n, lo=5, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _page_bytes(llm):
    return llm.engine.runner.layout.page_bytes


def _assert_clean(llm):
    stats = llm.engine.stats()
    assert stats.kv.num_blocks_in_use == 0
    report = llm.engine.audit()
    assert report.is_clean, report.findings


def test_batch_equals_one_at_a_time(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    prompts = _prompts(6)
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    _assert_clean(llm)


def test_chunked_prefill_equals_whole_prefill(tiny_dir):
    prompts = _prompts(4, 100, 300, seed=1)
    whole = LLM(str(tiny_dir), kv_memory="8MiB", max_batched_tokens=2048).generate(prompts, GREEDY)
    chunked_llm = LLM(str(tiny_dir), kv_memory="8MiB", max_batched_tokens=37)
    chunked = chunked_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked]
    assert chunked_llm.engine.stats().num_steps > 12 + 4 * 100 // 37  # it really chunked
    _assert_clean(chunked_llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pressure_preempts_and_outputs_stay_identical(tiny_dir, mode):
    prompts = _prompts(16, 40, 60, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    calm = LLM(str(tiny_dir), kv_memory="16MiB").generate(prompts, params)
    probe = LLM(str(tiny_dir), kv_memory="16MiB")
    per_seq_blocks = -(-(60 + 40) // 16)
    tight = LLM(str(tiny_dir), kv_memory=4 * per_seq_blocks * _page_bytes(probe),
                preemption_mode=mode, enable_prefix_caching=False)
    assert tight.engine.num_blocks == 4 * per_seq_blocks  # room for 4 sequences, 16 submitted
    pressed = tight.generate(prompts, params)
    assert [o.token_ids for o in pressed] == [o.token_ids for o in calm]
    stats = tight.engine.stats()
    preemptions = stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute
    assert preemptions > 0
    assert sum(o.num_preemptions for o in pressed) == preemptions
    _assert_clean(tight)


def test_prompt_over_window_is_refused_at_once(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    with pytest.raises(ContextLengthExceeded) as e:
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    msg = str(e.value)
    assert "1024" in msg and "1000" in msg and "100" in msg
    assert isinstance(e.value, ValueError)
    assert not llm.engine.has_unfinished_requests and llm.engine.stats().kv.num_blocks_in_use == 0


def test_prompt_over_the_whole_pool_is_refused_not_queued(tiny_dir):
    probe = LLM(str(tiny_dir), kv_memory="8MiB")
    llm = LLM(str(tiny_dir), kv_memory=10 * _page_bytes(probe))  # 10 blocks = 160 tokens
    with pytest.raises(KVCapacityExceeded) as e:
        llm.generate([[5] * 150], SamplingParams(max_tokens=20))
    assert "10" in str(e.value) and "160" in str(e.value)
    assert not llm.engine.has_unfinished_requests
    # a batch with one impossible prompt queues none of them
    with pytest.raises(KVCapacityExceeded):
        llm.generate([[5] * 10, [5] * 150], SamplingParams(max_tokens=20))
    assert not llm.engine.has_unfinished_requests
    assert llm.generate([[5] * 100], SamplingParams(max_tokens=60, ignore_eos=True))[0].finish_reason == "length"


def test_abort_releases_blocks_in_the_same_call(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    eng = llm.engine
    req = eng.add_request(_prompts(1, 50, 50)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.stats().kv.num_blocks_in_use > 0
    assert eng.abort(req.request_id)
    assert eng.stats().kv.num_blocks_in_use == 0
    assert req.finish_reason is FinishReason.ABORT
    outs = eng.step()
    assert [o.finish_reason for o in outs if o.request_id == req.request_id] == [FinishReason.ABORT]
    assert not eng.abort(req.request_id)
    _assert_clean(llm)


def test_prefix_cache_hits_within_a_namespace_only(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    eng = llm.engine
    prompt = _prompts(1, 200, 200, seed=5)[0]

    def run(ns):
        req = eng.add_request(prompt, GREEDY, namespace=ns)
        while not req.is_finished:
            eng.step()
        return req

    first, again, other = run("tenant-a"), run("tenant-a"), run("tenant-b")
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 192  # 12 full blocks; the last prompt token is recomputed
    assert other.num_cached_tokens == 0
    assert first.output_token_ids == again.output_token_ids == other.output_token_ids
    assert eng.stats().kv.num_cross_namespace_hits == 0


def test_seeded_sampling_is_reproducible(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    p = _prompts(3, seed=7)
    a = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True))
    b = llm.generate(p[::-1], SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]
    c = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=124, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_prompt_logprobs_and_logprobs(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB", max_batched_tokens=16)
    prompt = _prompts(1, 40, 40, seed=8)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2,
                                                ignore_eos=True))[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert all(lp.logprob <= 0 for lp in out.prompt_logprobs[1:])
    assert len(out.logprobs) == 4 and all(len(t.top_logprobs) == 3 for t in out.logprobs)
    # greedy picks the most likely token: its logprob is the top-1 alternative's
    assert all(t.token_id == t.top_logprobs[0].token_id for t in out.logprobs)


def test_stream_deltas_join_to_the_text(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    deltas = [o.text_delta for o in llm.stream("It is a truth universally acknowledged", params)]
    full = llm.generate(["It is a truth universally acknowledged"], params)[0].text
    assert "".join(deltas) == full and len(deltas) == 20


def test_stopping_a_stream_early_releases_its_blocks(tiny_dir):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    stream = llm.stream("Emma Woodhouse, handsome, clever", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    _assert_clean(llm)


def test_a_failed_step_ends_its_requests_and_leaks_nothing(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir), kv_memory="8MiB")
    eng = llm.engine
    prompt = _prompts(1, 100, 100, seed=11)[0]
    real_forward = eng.runner.forward

    def broken(batch):  # fault injection: the real runner, failing on its first call
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(eng.runner, "forward", broken)
    req = eng.add_request(prompt, GREEDY)
    outs = eng.step()
    assert [(o.finish_reason, o.error) for o in outs] == [(FinishReason.ERROR, "RuntimeError: simulated device fault")]
    assert eng.stats().kv.num_blocks_in_use == 0 and not eng.has_unfinished_requests
    monkeypatch.setattr(eng.runner, "forward", real_forward)
    # the failed step's blocks were never written: the same prompt must not hit them
    again = eng.add_request(prompt, GREEDY)
    while not again.is_finished:
        eng.step()
    assert again.num_cached_tokens == 0
    assert tuple(again.output_token_ids) == LLM(str(tiny_dir), kv_memory="8MiB").generate([prompt], GREEDY)[0].token_ids
    _assert_clean(llm)


def test_a_checkpoint_without_tokenizer_runs_on_token_ids(tmp_path):
    from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

    bare = make_checkpoint(MakeModelOptions(arch="qwen2", out_dir=tmp_path / "bare", hidden_size=32,
                                            num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300,
                                            with_tokenizer=False))
    llm = LLM(str(bare), kv_memory="4MiB")
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3, 4]], GREEDY)[0]
    assert len(out.token_ids) == 12 and out.text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["some text"], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 300\)"):
        llm.generate([[1, 999]], GREEDY)


def test_prompt_logprobs_survive_prefix_hits_and_preemption(tiny_dir):
    prompts = _prompts(6, 60, 60, seed=12)
    params = SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=1, ignore_eos=True)
    calm = LLM(str(tiny_dir), kv_memory="8MiB", max_batched_tokens=16).generate(prompts, params)
    probe = LLM(str(tiny_dir), kv_memory="8MiB")
    tight = LLM(str(tiny_dir), kv_memory=2 * 6 * _page_bytes(probe), max_batched_tokens=16,
                preemption_mode="recompute")
    warm = tight.generate(prompts[:1], params)  # the same prompt again below: a would-be hit
    pressed = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions_recompute > 0
    for a, b in zip(calm, pressed):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == 60
        assert [t and t.token_id for t in a.prompt_logprobs] == [t and t.token_id for t in b.prompt_logprobs]
        assert all(x is None or abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.prompt_logprobs, b.prompt_logprobs))
    # the repeat of the warm prompt was scored in full, not served from the prefix cache
    assert pressed[0].num_cached_tokens == 0
    assert [t and t.token_id for t in warm[0].prompt_logprobs] == [t and t.token_id for t in pressed[0].prompt_logprobs]


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

    return make_checkpoint(MakeModelOptions(arch="mistral", out_dir=tmp_path_factory.mktemp("mistral"),
                                            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                            vocab_size=512, max_position=1024, sliding_window=40,
                                            with_tokenizer=False))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_sliding_window_engine_releases_blocks_and_keeps_outputs(sliding_dir, mode):
    """Windows release blocks as sequences grow; chunking, batching and pressure change nothing."""
    prompts = _prompts(8, 90, 130, seed=13)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    alone = [LLM(str(sliding_dir), kv_memory="8MiB").generate([p], params)[0].token_ids for p in prompts[:2]]
    probe = LLM(str(sliding_dir), kv_memory="8MiB")
    window_blocks = -(-(40 - 1 + 16) // 16) + 1  # what a rolling group holds with 16-token chunks
    assert probe.engine.scheduler.kv.layout.groups[0].window_tokens == 40
    tight = LLM(str(sliding_dir), kv_memory=(window_blocks + 2) * _page_bytes(probe), max_batched_tokens=16,
                preemption_mode=mode)
    pressed = tight.generate(prompts, params)
    assert [o.token_ids for o in pressed[:2]] == alone
    # sequences of up to 190 tokens in a pool of 7 blocks (112 tokens): only possible because
    # the window released blocks as they grew; the rest waited or were preempted
    assert tight.engine.num_blocks == 7 < -(-190 // 16)
    assert all(len(o.token_ids) == 60 for o in pressed)
    # a rolling window cannot be swapped back in whole: sliding layouts always recompute
    assert tight.engine.stats().num_preemptions_swap == 0
    _assert_clean(tight)


def test_prompt_logprobs_take_no_prefix_hit_but_leave_their_blocks_for_others(tiny_dir):
    """Scoring a prompt computes every position (no hit), under the tenant's real namespace:
    its full blocks are registered, so a plain request of the same tenant hits them."""
    prompt = _prompts(1, 200, 200, seed=9)[0]
    scoring = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)

    def run(eng, params, ns="t"):
        req = eng.add_request(prompt, params, namespace=ns)
        while not req.is_finished:
            eng.step()
        return req

    eng = LLM(str(tiny_dir), kv_memory="8MiB").engine
    plain = run(eng, GREEDY)
    assert run(eng, scoring).num_cached_tokens == 0  # a hit was there to take: not taken
    eng = LLM(str(tiny_dir), kv_memory="8MiB").engine
    first = run(eng, scoring)
    assert first.num_cached_tokens == 0 and len(first.prompt_logprobs) == len(prompt)
    assert run(eng, GREEDY).num_cached_tokens == 192  # the scored request's 12 full blocks
    assert run(eng, GREEDY, ns="other").num_cached_tokens == 0
    assert plain.output_token_ids[:2] == first.output_token_ids


def test_a_malformed_tokenizer_is_an_error_not_a_missing_tokenizer(tiny_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="tokenizer.json cannot be read as a tokenizer"):
        LLM(str(broken), kv_memory="8MiB")
    (broken / "tokenizer.json").unlink()
    assert LLM(str(broken), kv_memory="8MiB").tokenizer is None  # none shipped: token ids only


def test_engine_options_in_either_dtype_vocabulary_and_named_errors():
    from ctxwarden.engine.config import EngineConfig

    assert EngineConfig(dtype="bfloat16").kv_dtype == "bf16" == EngineConfig(dtype="bf16").dtype
    assert EngineConfig(dtype="float32", kv_dtype="bfloat16").kv_dtype == "bf16"
    with pytest.raises(ValueError, match="int3.*fp32, bf16, fp16"):
        EngineConfig(dtype="int3")
    with pytest.raises(TypeError, match="unknown engine option.*kv_memroy"):
        EngineConfig.build(kv_memroy="1GiB")
