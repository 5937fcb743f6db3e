"""The attention monitor against transformers' eager attentions (fp32) on random checkpoints.

Per head: entropy normalised by log(visible keys) and sink mass within 1e-4 of a numpy
reference computed from `output_attentions=True`; the sink rate equal; rollout rows sum to 1
and equal the numpy product; the mass by decile sums to 1. The monitor leaves the model's
output bit-identical (it only observes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxwarden.engine.config import EngineConfig
from ctxwarden.engine.engine import Engine
from ctxwarden.runner.attention_probe import probe_attention
from ctxwarden.sampling import SamplingParams
from runner_parity import hf_model

ARCH_OPTIONS = {
    "llama": {},
    "qwen2": {},  # q/k/v biases
    "gemma2": {"sliding_window": 8},  # soft-capping, sliding layers
}


def _reference(ids: list[int], model) -> dict:
    """Per-layer entropy, sink mass and sink rate, rollout: numpy on transformers' eager attentions."""
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    n = len(ids)
    layers, rollout, last_rows = [], np.eye(n), []
    for a in (x[0].double().numpy() for x in attentions):  # [H, n, n]
        visible = (a > 0).sum(-1)  # [H, n] keys with nonzero weight (= the mask here)
        h = -np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0).sum(-1)
        rows = visible[0] > 1
        layers.append({"entropy": (h[:, rows] / np.log(visible[:, rows])).mean(-1), "sink_mass": a[:, :, 0].mean(-1),
                       "alpha": a[:, 1:, 0].mean(-1)})
        step = 0.5 * a.mean(0) + 0.5 * np.eye(n)
        rollout = (step / step.sum(-1, keepdims=True)) @ rollout
        last_rows.append(a.mean(0)[-1])
    return {"layers": layers, "rollout": rollout, "last_row": np.mean(last_rows, 0),
            "sink_rate": float(np.mean([layer["alpha"] > 0.3 for layer in layers]))}


@pytest.mark.parametrize("arch", list(ARCH_OPTIONS))
def test_entropy_sink_mass_rollout_match_transformers_eager(tiny_model, arch):
    model_dir = tiny_model(arch, **ARCH_OPTIONS[arch])
    engine = Engine(EngineConfig.build(model=str(model_dir), kv_memory="8MiB", attention_sample_rate=1.0,
                                       enable_prefix_caching=False))
    ids = [1 + (37 * j + 11) % 250 for j in range(45)]
    _check_against_reference(probe_attention(engine, ids).to_dict(), _reference(ids, hf_model(model_dir)), ids)


@pytest.mark.slow
def test_smollm2_entropy_sink_mass_rollout_match_transformers_eager(hf_smollm2):
    """The real default model (its Q4_1 GGUF, dequantized by both sides): 30 layers x 9 heads,
    real attention with real sinks, not the near-uniform attention of a random checkpoint."""
    engine = Engine(EngineConfig.build(kv_memory="64MiB", weights="fp32", attention_sample_rate=1.0,
                                       enable_prefix_caching=False))
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."
    ids = engine.tokenizer.encode(text)
    got = probe_attention(engine, ids).to_dict()
    want = _reference(ids, hf_smollm2[1])
    assert max(want["sink_rate"], *(layer["sink_mass"].max() for layer in want["layers"])) > 0.3  # real sinks
    _check_against_reference(got, want, ids)


def _check_against_reference(got: dict, want: dict, ids: list[int]) -> None:
    for l, layer in enumerate(want["layers"]):
        np.testing.assert_allclose([h["entropy"] for h in got["layers"][l]], layer["entropy"], atol=1e-4, rtol=0)
        np.testing.assert_allclose([h["sink_mass"] for h in got["layers"][l]], layer["sink_mass"], atol=1e-4, rtol=0)
    assert got["sink_rate"] == pytest.approx(want["sink_rate"], abs=1e-12)
    last = np.array(got["rollout_last_row"])
    np.testing.assert_allclose(last, want["rollout"][-1], atol=1e-6)
    assert last.sum() == pytest.approx(1.0, abs=1e-9)
    bins = (np.arange(len(ids)) * 10) // len(ids)
    np.testing.assert_allclose(got["position_mass"], [want["last_row"][bins == b].sum() for b in range(10)], atol=1e-6)


def test_the_monitor_changes_no_output(tiny_model):
    model_dir = tiny_model("llama")
    ids = [1 + (13 * j) % 250 for j in range(30)]
    outs = []
    for rate in (0.0, 1.0):
        engine = Engine(EngineConfig.build(model=str(model_dir), kv_memory="8MiB", attention_sample_rate=rate))
        engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0, logprobs=1), request_id="r")
        tokens, logprobs = [], []
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs]
        outs.append((tokens, logprobs))
        assert (engine.attention is None) == (rate == 0.0)
    assert outs[0] == outs[1]


PREFIX = [1 + (29 * j + 5) % 250 for j in range(48)]  # 3 blocks of 16: the part the prefix cache serves
SUFFIX = [1 + (17 * j + 3) % 250 for j in range(13)]  # request "b" = PREFIX + SUFFIX, 61 tokens
NUM_NEW = 8  # the first from the prefill's last row, then 7 decode rows (positions 61-67)
# Equal within 1e-5: the cached run's prefix keys were computed in another request's 55-token
# prefill, the recomputed run's in its own 61-token one: the same arithmetic on other matrix
# shapes, which may round differently in fp32 (at most 1.5e-8 on these averages, measured). A
# monitor that missed the cached keys (1 of 48+ visible keys: about 2% of the mass of a
# near-uniform row) or read them at wrong positions would be off by 1e-3 or more.
CACHE_TOL = 1e-5


def _run_b(model_dir, warm: bool, stride: int | None = None):
    """Request b's attention record and tokens; with `warm`, another request with the same
    48-token prefix runs first, so b's prefix comes from the prefix cache."""
    engine = Engine(EngineConfig.build(model=str(model_dir), kv_memory="8MiB", attention_sample_rate=1.0,
                                       enable_prefix_caching=True, block_size=16))
    if stride is not None:
        engine.attention.prefill_stride = stride
    runs = [("warm", PREFIX + [7, 8, 9, 10, 11, 12, 13])] if warm else []
    tokens = []
    for rid, ids in runs + [("b", PREFIX + SUFFIX)]:
        engine.add_request(ids, SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True), request_id=rid)
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens += out.new_token_ids if out.request_id == "b" else []
    engine.release_finished()
    return engine.attention_done["b"], tokens, engine.stats().kv.num_prefix_hit_tokens


def test_a_cached_prefix_gives_the_statistics_of_a_recomputed_one(tiny_model):
    model_dir = tiny_model("llama")
    cached, cached_tokens, hits = _run_b(model_dir, warm=True)
    fresh, fresh_tokens, no_hits = _run_b(model_dir, warm=False)
    assert (hits, no_hits) == (48, 0) and cached_tokens == fresh_tokens
    assert (cached.prompt_positions_cached, fresh.prompt_positions_cached) == (48, 0)
    # rows observed (live stride 4, by position): prompt rows 3, 7, ..., 59 and 60 recomputed
    # (16) against 51, 55, 59, 60 after the cache (4); the 7 generated rows in both
    assert [int(fresh.sink_rows[0]), int(cached.sink_rows[0])] == [16 + 7, 4 + 7]
    assert int(fresh.generated_sink_rows[0]) == int(cached.generated_sink_rows[0]) == NUM_NEW - 1
    for got, want in ((cached.generated_entropy(), fresh.generated_entropy()),
                      (cached.generated_sink_mass(), fresh.generated_sink_mass())):
        assert float((got - want).abs().max()) < CACHE_TOL
    # every figure equal when both observe the same rows (the prompt's last and the generated)
    cached, _, _ = _run_b(model_dir, warm=True, stride=10**6)
    fresh, _, _ = _run_b(model_dir, warm=False, stride=10**6)
    assert int(cached.sink_rows[0]) == int(fresh.sink_rows[0]) == 1 + NUM_NEW - 1
    for got, want in ((cached.entropy(), fresh.entropy()), (cached.sink_mass(), fresh.sink_mass()),
                      (cached.alpha(), fresh.alpha())):
        assert float((got - want).abs().max()) < CACHE_TOL
    assert cached.to_dict()["sink_rate"] == fresh.to_dict()["sink_rate"]
    live = _run_b(model_dir, warm=True)[0].to_dict()
    assert live["prompt_positions_cached"] == 48 and live["generated"]["rows"] == NUM_NEW - 1
