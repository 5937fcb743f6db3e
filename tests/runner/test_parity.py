"""Paged == dense: our runner's logits match transformers on the same tiny checkpoints.

Every case prefills a prompt (lengths that are and are not block multiples), compares the
logits of every prompt row, then decodes 32 greedy tokens comparing each step's logits
(fp32, within 1e-4) and requiring identical tokens.
"""

from __future__ import annotations

import pytest

from runner_parity import TOL, hf_model, hf_reference, make_runner, max_diff, paged_run, prompt_ids

NUM_DECODE = 32
_HF = {}


def _reference(model_dir, length: int, num_decode: int = NUM_DECODE, seed: int = 0):
    key = (str(model_dir), length, num_decode, seed)
    if key not in _HF:
        model = _HF.setdefault(str(model_dir), hf_model(model_dir))
        _HF[key] = hf_reference(model, prompt_ids(length, 512, seed), num_decode)
    return _HF[key]


def _check(model_dir, length: int, block_size: int, chunk_tokens: int | None = None, rope_prompt: bool = False,
           **config):
    ref = _reference(model_dir, length)
    runner = make_runner(model_dir, block_size, length + NUM_DECODE + 1, **config)
    ours = paged_run(runner, prompt_ids(length, 512), NUM_DECODE, chunk_tokens, rope_prompt=rope_prompt)
    diff = max_diff(ours, ref)
    assert diff < TOL, f"max |logit diff| {diff:.2e} >= {TOL}"
    assert ours.tokens == ref.tokens
    return diff


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 1000])
def test_llama_prompt_lengths_and_block_sizes(tiny_model, length, block_size):
    _check(tiny_model("llama"), length, block_size)


ARCH_OPTIONS = {
    "mistral": dict(sliding_window=24),  # windows shorter than the prompt: exercises rolling
    "qwen2": dict(),  # q/k/v bias
    "qwen3": dict(head_dim=32),  # q/k norm, head_dim != hidden / heads
    "gemma2": dict(sliding_window=24),  # local/global, soft-caps, sandwich norms
    "phi3": dict(partial_rotary_factor=0.5),  # fused qkv / gate_up, partial rotary
}


@pytest.mark.parametrize("length", [17, 100])
@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_architectures(tiny_model, arch, length):
    _check(tiny_model(arch, **ARCH_OPTIONS[arch]), length, block_size=16)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
@pytest.mark.parametrize("block_size", [1, 32])
def test_sliding_window_block_sizes(tiny_model, arch, block_size):
    _check(tiny_model(arch, **ARCH_OPTIONS[arch]), 100, block_size)


ROPE_CASES = {
    "linear": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), [100]),
    # dynamic NTK stretches past max_position (64): a prompt beyond it, and one that crosses
    # it during decode (frequencies change per step, as in transformers)
    "dynamic": (dict(max_position=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), [40, 100]),
    "yarn": (dict(max_position=256, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64}), [100]),
    "llama3": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), [100]),
    # longrope switches short -> long factors past original_max_position_embeddings (48)
    "longrope": (dict(max_position=192, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 48,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)]}), [17, 100]),
}


@pytest.mark.parametrize("case", [(name, n) for name, (_, lens) in ROPE_CASES.items() for n in lens],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_rope_variants(tiny_model, case):
    name, length = case
    _check(tiny_model("llama", **ROPE_CASES[name][0]), length, block_size=16)


def test_partial_rotary_with_longrope(tiny_model):
    options = dict(partial_rotary_factor=0.5, max_position=192, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 48,
        "short_factor": [1.0 + 0.1 * i for i in range(4)],
        "long_factor": [1.0 + 0.5 * i for i in range(4)]})
    _check(tiny_model("phi3", **options), 100, block_size=16)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_rope_in_chunks_equals_one_forward_over_the_prompt(tiny_model, name):
    """A 100-token prompt past the trained length (64 / 48), prefilled in chunks of 33: told the
    prompt's length, every chunk rotates as transformers' single forward over the prompt did
    (then decode steps as in generate). Without it, the first chunks take the unscaled base
    (dynamic) or the short factors (longrope) and the logits move far past the tolerance."""
    model_dir = tiny_model("llama", **ROPE_CASES[name][0])
    _check(model_dir, 100, block_size=16, chunk_tokens=33, rope_prompt=True)
    with pytest.raises(AssertionError, match="max .logit diff"):
        _check(model_dir, 100, block_size=16, chunk_tokens=33)


@pytest.mark.parametrize("arch,chunk", [("llama", 33), ("llama", 16), ("mistral", 10), ("gemma2", 40)])
def test_chunked_prefill(tiny_model, arch, chunk):
    """A prompt fed in chunks attends to the cached tokens plus causal inside the chunk."""
    options = ARCH_OPTIONS.get(arch, {})
    _check(tiny_model(arch, **options), 100, block_size=16, chunk_tokens=chunk)
