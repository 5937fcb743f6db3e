"""Gemma-3 runs: parity with transformers' Gemma3ForCausalLM, its 5:1 pool cut, plan == pool.

The checkpoint is a 6-layer random Gemma-3 (layers 0-4 local with a 24-token window, layer 5
global), head_dim 32 but query_pre_attn_scalar 16 (hidden / heads, Gemma-3-27B's rule),
local RoPE base 10,000 and global base 1e6 with linear x8 scaling (as Gemma-3 4B and up):
a runner that scaled by head_dim, rotated every layer alike, skipped the (1 + w) q/k norms
or let the local layers see past their window would miss the 1e-4 logit tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

from ctxwarden.llm import LLM
from ctxwarden.plan import blocks_needed, kv_layout, plan_memory
from ctxwarden.runner import ModelRunner, RunnerConfig
from ctxwarden.sampling import SamplingParams
from ctxwarden.spec.checkpoint import resolve_checkpoint
from ctxwarden.spec.model_spec import FULL, SLIDING, load_model_config
from runner_parity import TOL, hf_model, hf_reference, make_runner, max_diff, paged_run, prompt_ids

GEMMA3 = dict(num_layers=6, head_dim=32, sliding_window=24, rope_theta=1e6,
              rope_scaling={"rope_type": "linear", "factor": 8.0})
NUM_DECODE = 32
MiB = 1024 ** 2


@pytest.fixture(scope="module")
def gemma3_dir(tiny_model):
    return tiny_model("gemma3", **GEMMA3)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    return hf_model(gemma3_dir)


def test_the_checkpoint_is_what_transformers_calls_gemma3(gemma3_dir, hf_gemma3):
    config = hf_gemma3.config
    assert type(hf_gemma3).__name__ == "Gemma3ForCausalLM"
    assert config.layer_types == [SLIDING] * 5 + [FULL]
    assert config.rope_parameters[SLIDING]["rope_theta"] == 10_000.0
    assert config.rope_parameters[FULL] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert config.query_pre_attn_scalar == 16 != config.head_dim
    spec = load_model_config(gemma3_dir)
    assert spec.layer_types == tuple(config.layer_types) and spec.qk_norm
    assert spec.rope_for_layer(0).theta == 10_000.0 and spec.rope_for_layer(5).params["factor"] == 8.0


@pytest.mark.parametrize("length,block_size,chunk", [
    (1, 16, None), (17, 16, None), (100, 16, None), (100, 1, None), (100, 32, None),
    (100, 16, 40), (100, 16, 7),  # chunked prefill, chunks shorter than the window too
])
def test_gemma3_matches_transformers(gemma3_dir, hf_gemma3, length, block_size, chunk):
    ref = hf_reference(hf_gemma3, prompt_ids(length, 512), NUM_DECODE)
    runner = make_runner(gemma3_dir, block_size, length + NUM_DECODE + 1)
    ours = paged_run(runner, prompt_ids(length, 512), NUM_DECODE, chunk)
    diff = max_diff(ours, ref)
    assert diff < TOL, f"max |logit diff| {diff:.2e} >= {TOL}"
    assert ours.tokens == ref.tokens


def test_five_to_one_cuts_the_pool_into_equal_groups(tiny_model):
    """12 layers = 10 local + 2 global: gcd 2, so 5 local groups and 1 global group of 2
    layers each (every page the same size); a 1,000-token sequence holds 63 blocks in the
    global group and 4 in each local one (window 24 with 16-token chunks: 24 - 1 + 16 = 39
    tokens straddle at most 4 blocks), not 6 x 63."""
    spec = load_model_config(tiny_model("gemma3", **{**GEMMA3, "num_layers": 12}))
    layout = kv_layout(spec, "bf16", 16)
    assert [(g.kind, g.layer_ids, g.window_tokens) for g in layout.groups] == [
        ("sliding", (0, 1), 24), ("sliding", (2, 3), 24), ("sliding", (4, 6), 24),
        ("sliding", (7, 8), 24), ("sliding", (9, 10), 24), ("full", (5, 11), None)]
    assert layout.page_bytes == 16 * 2 * (2 * 2 * 32 * 2)  # tokens x layers x K+V bytes
    assert blocks_needed(1000, layout, chunk_tokens=16) == 63 + 5 * 4


@pytest.mark.parametrize("kv_dtype,block_size", [("fp32", 16), ("bf16", 1)])
def test_gemma3_allocated_kv_bytes_equal_the_plan(gemma3_dir, kv_dtype, block_size):
    ckpt = resolve_checkpoint(gemma3_dir)
    plan = plan_memory(ckpt.spec, memory_bytes=ckpt.weights_bytes + 3 * MiB,
                       weights_bytes=ckpt.weights_bytes, weights_source="safetensors header",
                       kv_dtype=kv_dtype, block_size=block_size, activation_reserve_bytes=0)
    runner = ModelRunner(ckpt, RunnerConfig(num_blocks=plan.num_blocks, block_size=block_size,
                                            kv_dtype=kv_dtype))
    assert plan.num_kv_groups == runner.layout.num_groups == 6
    assert runner.kv_cache.nbytes == plan.kv_pool_bytes > 0


def test_gemma3_engine_under_pressure_gives_transformers_greedy_text(gemma3_dir, hf_gemma3):
    """The engine with a pool too small to charge local layers in full: the local groups
    release blocks as sequences grow, requests wait or are preempted, and every greedy
    continuation is transformers' own generate()."""
    prompts = [prompt_ids(n, 512, seed=n) for n in (90, 120, 150)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    probe = LLM(str(gemma3_dir), kv_memory="4MiB")
    page_bytes = probe.engine.runner.layout.page_bytes
    # one 174-token sequence: 11 global blocks + 5 x 4 local ones; 6 x 11 without release
    tight = LLM(str(gemma3_dir), kv_memory=40 * page_bytes, max_batched_tokens=16)
    outputs = tight.generate(prompts, params)
    assert tight.engine.num_blocks == 40 < 6 * -(-174 // 16)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ref = hf_gemma3.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
            assert list(out.token_ids) == ref[0, len(prompt):].tolist()
    assert tight.engine.stats().kv.num_blocks_in_use == 0
    assert tight.engine.audit().is_clean


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_wrapper_runs_its_text_model(gemma3_dir, hf_gemma3, tmp_path, prefix):
    """Gemma-3 4B and up ship as `gemma3` wrappers: the text model's config under
    `text_config`, its tensors under a prefix (hub files: language_model.model.*;
    transformers 5.x saves model.language_model.*), next to a vision tower we do not run."""
    from safetensors.torch import load_file, save_file

    text_config = json.loads((gemma3_dir / "config.json").read_text())
    wrapper = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": text_config, "vision_config": {"model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    tensors = {prefix + k.removeprefix("model."): v
               for k, v in load_file(gemma3_dir / "model.safetensors").items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ref = hf_reference(hf_gemma3, prompt_ids(40, 512), 8)
    runner = make_runner(tmp_path, 16, 40 + 8 + 1)
    assert runner.spec.model_type == "gemma3_text" and runner.spec.tie_word_embeddings
    ours = paged_run(runner, prompt_ids(40, 512), 8)
    assert max_diff(ours, ref) < TOL and ours.tokens == ref.tokens
