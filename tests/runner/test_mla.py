"""DeepSeek-V2/V3 (multi-head latent attention + MoE) against transformers on the same files.

The tiny checkpoints (`make-model --arch deepseek_v2|deepseek_v3`) have MLA with a 32-wide
latent, 8 rope + 16 nope dims per head, 4 routed experts (top 2) + 1 shared, layer 0 dense.
Logits of these models are small (std ~0.16), so the bound is 1e-5, not the 1e-4 of the
other architectures: a 1% error in the softmax scale moves them by 1.1e-4, skipping the
rope de-interleave by 7.6e-3 (both measured); the runner's diff is <= 2.4e-7.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ctxwarden.errors import ConfigError
from ctxwarden.models.deepseek import DeepseekForCausalLM
from ctxwarden.spec.checkpoint import resolve_checkpoint
from ctxwarden.spec.model_spec import parse_model_config
from ctxwarden.plan import plan_memory
from ctxwarden.runner import ModelRunner, RunnerConfig
from runner_parity import hf_model, hf_reference, make_runner, max_diff, paged_run, prompt_ids, sink_mode_diff

MLA_TOL = 1e-5
NUM_DECODE = 12
_HF = {}

CASES = {
    # V2 as DeepSeek-V2-Lite: no query LoRA, softmax routing, greedy top-k
    "v2": ("deepseek_v2", {}),
    # V2 with query LoRA and group-limited routing (2 groups of 2 experts, 1 kept)
    "v2-grouped": ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy",
                                   "n_group": 2, "topk_group": 1}),
    # V3: query LoRA, sigmoid routing + correction bias, groups, interleaved rope
    "v3": ("deepseek_v3", {}),
    # V3 without interleave (plain half-split rope), all layers MoE, 2 shared experts
    "v3-plain-rope": ("deepseek_v3", {"rope_interleave": False, "first_k_dense_replace": 0,
                                      "n_shared_experts": 2}),
    # DeepSeek's YaRN: mscale in the cos/sin and mscale_all_dim in the softmax scale
    "v3-yarn": ("deepseek_v3", {"max_position_embeddings": 256, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}}),
}


def _model(tiny_model, case: str):
    arch, overrides = CASES[case]
    return tiny_model(arch, config_overrides=overrides)


def _check(model_dir, length: int, block_size: int, chunk_tokens: int | None = None) -> float:
    key = (str(model_dir), length)
    if key not in _HF:
        _HF[key] = hf_reference(hf_model(model_dir), prompt_ids(length, 512), NUM_DECODE)
    ref = _HF[key]
    runner = make_runner(model_dir, block_size, length + NUM_DECODE + 1)
    ours = paged_run(runner, prompt_ids(length, 512), NUM_DECODE, chunk_tokens)
    diff = max_diff(ours, ref)
    assert diff < MLA_TOL, f"max |logit diff| {diff:.2e} >= {MLA_TOL}"
    assert ours.tokens == ref.tokens
    return diff


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_prefill_and_decode_match_transformers(tiny_model, case):
    """Prefill logits of every row, then 12 greedy decode steps (logits and tokens)."""
    _check(_model(tiny_model, case), 37, block_size=16)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("case", ["v2", "v3"])
def test_mla_block_sizes_and_chunked_prefill(tiny_model, case, block_size):
    """Page size 1 and 16; the prompt (100 tokens, not a block multiple) whole, in chunks of
    33 (expanded: the tiny shapes expand a chunk of n after c cached when 1024 c < 40 n (n + c))
    and of 10 (later chunks absorbed)."""
    model_dir = _model(tiny_model, case)
    _check(model_dir, 100, block_size)
    _check(model_dir, 100, block_size, chunk_tokens=33)  # chunks 2 and 3 expanded
    _check(model_dir, 100, block_size, chunk_tokens=10)  # chunks 2... absorbed


@pytest.mark.parametrize("case", ["v2", "v3"])
def test_mla_planned_kv_bytes_equal_allocated(tiny_model, case):
    """The pool holds (kv_lora_rank + qk_rope_head_dim) values per token per layer, once."""
    ckpt = resolve_checkpoint(_model(tiny_model, case))
    mla, block_size = ckpt.spec.mla, 16
    plan = plan_memory(ckpt.spec, memory_bytes=ckpt.weights_bytes + (1 << 20),
                       weights_bytes=ckpt.weights_bytes, weights_source="safetensors header",
                       kv_dtype="fp32", block_size=block_size, activation_reserve_bytes=0)
    runner = ModelRunner(ckpt, RunnerConfig(num_blocks=plan.num_blocks, block_size=block_size))
    cache = runner.kv_cache
    assert plan.num_blocks > 0 and cache.nbytes == plan.kv_pool_bytes
    per_token = ckpt.spec.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert plan.kv_pool_bytes == plan.num_blocks * block_size * per_token
    assert all(v is k for k, v in zip(cache.keys, cache.values))  # values are the cached rows
    assert all(k.shape == (plan.num_blocks, block_size, 1, 40) for k in cache.keys)


def test_mla_pages_round_trip_through_bytes(tiny_model):
    """read_pages / write_pages (swap and KV tiers) move a page of the shared layout intact."""
    runner = make_runner(_model(tiny_model, "v3"), 16, 64)
    cache = runner.kv_cache
    for k in cache.keys:
        k.copy_(torch.randn(k.shape))
    pages = cache.read_pages([1, 3])
    assert pages.shape == (2, runner.layout.page_bytes)
    expected = [k[1].clone() for k in cache.keys]
    cache.write_pages([0, 2], list(pages))
    assert all(torch.equal(k[0], e) for k, e in zip(cache.keys, expected))
    assert all(torch.equal(k[2], k[3]) for k in cache.keys)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_engine_greedy_text_equals_transformers_generate(tiny_model, arch):
    """LLM.generate on two batched prompts gives transformers' greedy tokens and text."""
    from transformers import AutoTokenizer

    from ctxwarden import LLM, SamplingParams

    model_dir = tiny_model(arch, with_tokenizer=True)
    prompts = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome"]
    llm = LLM(str(model_dir), kv_memory="4MiB", weights="fp32", block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    tok, model = AutoTokenizer.from_pretrained(str(model_dir)), hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt)["input_ids"]
        assert list(out.prompt_token_ids) == ids
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
        assert list(out.token_ids) == ref.tolist()[:len(out.token_ids)] and len(out.token_ids) > 0
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_under_pressure_gives_the_calm_outputs(tiny_model, mode):
    """Preempted MLA sequences (pages swapped out and back, or recomputed) decode the same."""
    from ctxwarden import LLM, SamplingParams

    model_dir = _model(tiny_model, "v3")
    prompts = [prompt_ids(n, 512, seed=n) for n in (30, 41, 52, 25, 47, 38)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    calm = LLM(str(model_dir), kv_memory="4MiB").generate(prompts, params)
    page_bytes = make_runner(model_dir, 16, 16).layout.page_bytes
    per_seq_blocks = -(-(52 + 24) // 16)
    tight = LLM(str(model_dir), kv_memory=2 * per_seq_blocks * page_bytes, preemption_mode=mode,
                enable_prefix_caching=False)
    pressed = tight.generate(prompts, params)
    assert [o.token_ids for o in pressed] == [o.token_ids for o in calm]
    stats = tight.engine.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert stats.kv.num_blocks_in_use == 0


def test_mla_absorbed_and_expanded_agree_under_a_window(tiny_model):
    """Window mode (no transformers reference): both attention paths read the same keys."""
    model_dir = _model(tiny_model, "v3")
    absorbed = make_runner(model_dir, 16, 120, window_tokens=32)
    absorbed.model.force_path = "absorbed"
    expanded = make_runner(model_dir, 16, 120, window_tokens=32)
    expanded.model.force_path = "expanded"  # every step, decode included
    a, b = (paged_run(r, prompt_ids(100, 512), 6, chunk_tokens=40) for r in (absorbed, expanded))
    assert max_diff(a, b) < MLA_TOL and a.tokens == b.tokens
    full = paged_run(make_runner(model_dir, 16, 120), prompt_ids(100, 512), 6)
    assert max_diff(a, full) > 1e-3  # the window really cut keys


@pytest.mark.parametrize("overrides,message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"n_group": 3}, "n_group dividing n_routed_experts (4)"),
    ({"topk_group": 3}, "topk_group <= n_group"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_mla_configs_that_cannot_run_are_refused_by_name(tiny_model, overrides, message):
    """Routing fields that would fail inside a forward are refused when the model loads."""
    model_dir = tiny_model("deepseek_v3")
    config = json.loads((model_dir / "config.json").read_text())
    bad = parse_model_config({**config, **overrides}, source="bad/config.json")
    with pytest.raises(ConfigError, match=re.escape(message)):
        DeepseekForCausalLM.expected_tensors(bad)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_sink_mode_matches_hf_on_the_kept_tokens(tiny_model, arch):
    """Streaming (4 sinks + window) over the latent cache: one MoE layer, so each token's
    latent row depends on it alone and the kept rows are transformers' cache on them."""
    model_dir = tiny_model(arch, num_layers=1, config_overrides={"first_k_dense_replace": 0})
    diff = sink_mode_diff(model_dir, block_size=4)
    assert diff < MLA_TOL, f"max |logit diff| {diff:.2e}"
