"""Shared helpers of the runner tests: tiny checkpoints, the HF reference, the paged side.

The reference is Hugging Face transformers on the same files (a test-only dependency);
the paged side is our ModelRunner with simple block tables (each sequence owns a set of
page ids per group, handed out from a shuffled list so that tables are not contiguous).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctxwarden.plan.kv import cdiv
from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput

TOL = 1e-4


def hf_model(model_dir: Path, **kwargs):
    """transformers' model on the same checkpoint, fp32, eager attention (exact softcaps)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager", **kwargs)
    return model.eval()


@dataclass
class Reference:
    """HF prefill logits of every prompt row, then greedy decode logits and tokens."""

    prefill_logits: torch.Tensor  # [n, vocab]
    decode_logits: list[torch.Tensor] = field(default_factory=list)  # each [vocab]
    tokens: list[int] = field(default_factory=list)  # greedy tokens (first from prefill)


@torch.inference_mode()
def hf_reference(model, prompt: list[int], num_decode: int) -> Reference:
    """Prefill `prompt` and decode `num_decode` greedy tokens with HF's own cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    ref = Reference(out.logits[0].float())
    cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    for _ in range(num_decode):
        ref.tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        ref.decode_logits.append(out.logits[0, -1].float())
        token = int(out.logits[0, -1].argmax())
    ref.tokens.append(token)
    return ref


class PageAllocator:
    """Hands out distinct page ids (shuffled) so groups and sequences never share a page."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_blocks: int) -> tuple[int, ...]:
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        assert len(taken) == num_blocks, "test pool too small"
        return tuple(taken)


def make_runner(model_dir: Path, block_size: int, max_tokens: int, num_seqs: int = 1,
                **config) -> ModelRunner:
    """A runner whose pool holds `num_seqs` sequences of `max_tokens` in every group."""
    from ctxwarden.spec.checkpoint import resolve_checkpoint
    from ctxwarden.plan.kv import kv_layout

    spec = resolve_checkpoint(model_dir).spec
    layout = kv_layout(spec, config.get("kv_dtype", "fp32"), block_size,
                       config.get("window_tokens"), config.get("sink_tokens", 0))
    num_blocks = num_seqs * layout.num_groups * cdiv(max_tokens, block_size)
    return ModelRunner(model_dir, RunnerConfig(num_blocks=num_blocks, block_size=block_size, **config))


def tables_for(runner: ModelRunner, pages: PageAllocator, max_tokens: int):
    """One block table per KV group, each long enough for `max_tokens`."""
    n = cdiv(max_tokens, runner.layout.block_size)
    return tuple(pages.table(n) for _ in range(runner.layout.num_groups))


def paged_run(runner: ModelRunner, prompt: list[int], num_decode: int,
              chunk_tokens: int | None = None, seed: int = 0, rope_prompt: bool = False) -> Reference:
    """Prefill (optionally in chunks) and decode greedily through the paged runner; with
    `rope_prompt`, every input says the prompt's length (SequenceInput.num_prompt_tokens)."""
    known = len(prompt) if rope_prompt else 0
    pages = PageAllocator(runner.config.num_blocks, seed)
    tables = tables_for(runner, pages, len(prompt) + num_decode + 1)
    chunk = chunk_tokens or len(prompt)
    rows = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        rows.append(runner.forward(ForwardBatch((SequenceInput.chunk(piece, start, tables, "all", known),))))
    ref = Reference(torch.cat(rows))
    token, cached = int(ref.prefill_logits[-1].argmax()), len(prompt)
    for _ in range(num_decode):
        ref.tokens.append(token)
        logits = runner.forward(ForwardBatch((SequenceInput.chunk([token], cached, tables, "last", known),)))[0]
        ref.decode_logits.append(logits)
        token, cached = int(logits.argmax()), cached + 1
    ref.tokens.append(token)
    return ref


def max_diff(ours: Reference, ref: Reference) -> float:
    """Largest absolute logit difference over prefill rows and decode steps."""
    d = (ours.prefill_logits - ref.prefill_logits).abs().max().item()
    for a, b in zip(ours.decode_logits, ref.decode_logits):
        d = max(d, (a - b).abs().max().item())
    return d


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list[int]:
    """A reproducible prompt of random token ids (special ids 0..2 avoided)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def poison_dropped_blocks(runner, tables, next_position: int, poison_page: int):
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
                fill_nan(runner, table[i])
                table[i] = poison_page
        new_tables.append(tuple(table))
    return tuple(new_tables)


def fill_nan(runner, page: int) -> None:
    """Fill page `page` of every pool tensor with NaN (a page no one may read)."""
    for t in runner.kv_cache.keys + runner.kv_cache.values:
        t[page] = float("nan")


def kept_tokens(tokens: list[int], position: int, sinks: int, window: int) -> list[int]:
    """What a StreamingLLM cache holds when the query is at `position` (query included)."""
    start = position - window + 1
    if start <= sinks:
        return tokens[:position + 1]
    return tokens[:sinks] + tokens[start:position + 1]


def sink_mode_diff(model_dir: Path, block_size: int) -> float:
    """Max |logit diff| of sink mode (4 sinks + a 12-token window, dropped blocks poisoned
    with NaN) against transformers run on the tokens the cache keeps, positions 0..n-1.

    Exact for a one-layer model only: then each token's K/V depend on the token alone.
    Chunks of 8 and 10 and single decode tokens, 60 tokens in all.
    """
    sinks, window, total = 4, 12, 60
    tokens = prompt_ids(total, 512, seed=3)
    model = hf_model(model_dir)
    runner = make_runner(model_dir, block_size, total, num_seqs=2, window_tokens=window, sink_tokens=sinks)
    pages = PageAllocator(runner.config.num_blocks - 1)
    poison = runner.config.num_blocks - 1
    fill_nan(runner, poison)
    tables = tables_for(runner, pages, total)
    chunks = [(0, 8)] + [(p, p + 1) for p in range(8, 40)] + [(40, 50)] + [(p, p + 1) for p in range(50, 60)]
    diff = 0.0
    for start, end in chunks:
        tables = poison_dropped_blocks(runner, tables, start, poison)
        logits = runner.forward(ForwardBatch((SequenceInput.chunk(tokens[start:end], start, tables, "all"),)))
        for row, position in enumerate(range(start, end)):
            kept = kept_tokens(tokens, position, sinks, window)
            with torch.inference_mode():
                expected = model(torch.tensor([kept])).logits[0, -1]
            diff = max(diff, (logits[row] - expected).abs().max().item())
    return diff
