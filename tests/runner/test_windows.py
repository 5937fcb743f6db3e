"""Windows: sliding layers read only the blocks inside their window, and sink mode
(StreamingLLM) matches transformers run on the tokens the cache keeps."""

from __future__ import annotations

import pytest
import torch

from ctxwarden.runner import ForwardBatch, SequenceInput
from runner_parity import (TOL, PageAllocator, fill_nan, hf_model, hf_reference, make_runner,
                           poison_dropped_blocks, prompt_ids, sink_mode_diff, tables_for)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_layers_never_read_blocks_outside_the_window(tiny_model, arch):
    model_dir = tiny_model(arch, sliding_window=24)
    num_decode, block = 24, 8
    prompt = prompt_ids(60, 512)
    ref = hf_reference(hf_model(model_dir), prompt, num_decode)
    runner = make_runner(model_dir, block, 60 + num_decode + 1, num_seqs=2)
    pages = PageAllocator(runner.config.num_blocks - 1)
    poison = runner.config.num_blocks - 1
    fill_nan(runner, poison)
    tables = tables_for(runner, pages, 60 + num_decode + 1)
    logits = runner.forward(ForwardBatch((SequenceInput.chunk(prompt, 0, tables, "all"),)))
    diff = (logits - ref.prefill_logits).abs().max().item()
    token, cached = int(logits[-1].argmax()), 60
    for step in range(num_decode):
        tables = poison_dropped_blocks(runner, tables, cached, poison)
        out = runner.forward(ForwardBatch((SequenceInput.chunk([token], cached, tables),)))[0]
        diff = max(diff, (out - ref.decode_logits[step]).abs().max().item())
        token, cached = int(out.argmax()), cached + 1
        assert token == ref.tokens[step + 1]
    assert diff < TOL


@pytest.mark.parametrize("block_size", [4, 16])
def test_sink_mode_matches_hf_on_the_kept_tokens(tiny_model, block_size):
    """One layer, so each token's K/V depend on it alone: then the sink cache is exactly
    transformers run on [sinks + window] with positions 0..n-1 (positions re-assigned)."""
    diff = sink_mode_diff(tiny_model("llama", num_layers=1), block_size)
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
