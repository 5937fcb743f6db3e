"""Windows: sliding layers read only the blocks inside their window, and sink mode
(StreamingLLM) matches transformers run on the tokens the cache keeps."""

from __future__ import annotations

import pytest
import torch

from ctxwarden.runner import ForwardBatch, SequenceInput
from runner_parity import TOL, PageAllocator, hf_model, hf_reference, make_runner, prompt_ids, tables_for


def _poison_dropped_blocks(runner, tables, next_position: int, poison_page: int):
    """Point every windowed group's blocks that fell out of the window at a NaN page, and
    fill the pages they held with NaN too (as if the block manager had reused them)."""
    layout = runner.layout
    new_tables = []
    for g, table in enumerate(tables):
        group = layout.groups[g]
        if group.window_tokens is None:
            new_tables.append(table)
            continue
        first_needed = next_position - group.window_tokens + 1
        sink_blocks = -(-layout.sink_tokens // layout.block_size)
        table = list(table)
        for i in range(sink_blocks, len(table)):
            if (i + 1) * layout.block_size <= first_needed:
                _fill_nan(runner, table[i])
                table[i] = poison_page
        new_tables.append(tuple(table))
    return tuple(new_tables)


def _fill_nan(runner, page: int) -> None:
    for t in runner.kv_cache.keys + runner.kv_cache.values:
        t[page] = float("nan")


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_layers_never_read_blocks_outside_the_window(tiny_model, arch):
    model_dir = tiny_model(arch, sliding_window=24)
    num_decode, block = 24, 8
    prompt = prompt_ids(60, 512)
    ref = hf_reference(hf_model(model_dir), prompt, num_decode)
    runner = make_runner(model_dir, block, 60 + num_decode + 1, num_seqs=2)
    pages = PageAllocator(runner.config.num_blocks - 1)
    poison = runner.config.num_blocks - 1
    _fill_nan(runner, poison)
    tables = tables_for(runner, pages, 60 + num_decode + 1)
    logits = runner.forward(ForwardBatch((SequenceInput.chunk(prompt, 0, tables, "all"),)))
    diff = (logits - ref.prefill_logits).abs().max().item()
    token, cached = int(logits[-1].argmax()), 60
    for step in range(num_decode):
        tables = _poison_dropped_blocks(runner, tables, cached, poison)
        out = runner.forward(ForwardBatch((SequenceInput.chunk([token], cached, tables),)))[0]
        diff = max(diff, (out - ref.decode_logits[step]).abs().max().item())
        token, cached = int(out.argmax()), cached + 1
        assert token == ref.tokens[step + 1]
    assert diff < TOL


def _kept_tokens(tokens: list[int], position: int, sinks: int, window: int) -> list[int]:
    """What a StreamingLLM cache holds when the query is at `position` (query included)."""
    start = position - window + 1
    if start <= sinks:
        return tokens[:position + 1]
    return tokens[:sinks] + tokens[start:position + 1]


@pytest.mark.parametrize("block_size", [4, 16])
def test_sink_mode_matches_hf_on_the_kept_tokens(tiny_model, block_size):
    """One layer, so each token's K/V depend on it alone: then the sink cache is exactly
    transformers run on [sinks + window] with positions 0..n-1 (positions re-assigned)."""
    model_dir = tiny_model("llama", num_layers=1)
    sinks, window, total = 4, 12, 60
    tokens = prompt_ids(total, 512, seed=3)
    model = hf_model(model_dir)
    runner = make_runner(model_dir, block_size, total, num_seqs=2, window_tokens=window, sink_tokens=sinks)
    pages = PageAllocator(runner.config.num_blocks - 1)
    poison = runner.config.num_blocks - 1
    _fill_nan(runner, poison)
    tables = tables_for(runner, pages, total)
    chunks = [(0, 8)] + [(p, p + 1) for p in range(8, 40)] + [(40, 50)] + [(p, p + 1) for p in range(50, 60)]
    diff = 0.0
    for start, end in chunks:
        tables = _poison_dropped_blocks(runner, tables, start, poison)
        logits = runner.forward(ForwardBatch((SequenceInput.chunk(tokens[start:end], start, tables, "all"),)))
        for row, position in enumerate(range(start, end)):
            kept = _kept_tokens(tokens, position, sinks, window)
            with torch.inference_mode():
                expected = model(torch.tensor([kept])).logits[0, -1]
            diff = max(diff, (logits[row] - expected).abs().max().item())
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
