"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): our GGUF loader (dequantise,
un-permute Q/K) and paged runner produce the same greedy continuation of a chat prompt as
transformers loading the same file."""

from __future__ import annotations

import pytest

from ctxwarden.spec.checkpoint import default_model_path
from ctxwarden.runner import ModelRunner, RunnerConfig
from runner_parity import hf_reference, paged_run

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_greedy_chat_continuation_matches_transformers(gguf_path, hf_smollm2):
    tokenizer, model = hf_smollm2
    messages = [{"role": "user", "content": "Write a short poem about the sea and a lighthouse."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ref = hf_reference(model, prompt, NUM_TOKENS - 1)
    runner = ModelRunner(None, RunnerConfig(num_blocks=16, block_size=16))
    ours = paged_run(runner, prompt, NUM_TOKENS - 1)
    assert ours.tokens == ref.tokens, tokenizer.decode(ours.tokens) + " != " + tokenizer.decode(ref.tokens)
    assert len(set(ours.tokens)) > 8  # a real continuation, not a repeated token
    diff = max((ours.prefill_logits[-1] - ref.prefill_logits[-1]).abs().max().item(),
               *((a - b).abs().max().item() for a, b in zip(ours.decode_logits, ref.decode_logits)))
    print(f"SmolLM2 max |logit diff| over {NUM_TOKENS} steps: {diff:.2e}")  # shown with -s
    assert diff < 1e-3, f"max |logit diff| {diff:.2e}"
