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
              chunk_tokens: int | None = None, seed: int = 0) -> Reference:
    """Prefill (optionally in chunks) and decode greedily through the paged runner."""
    pages = PageAllocator(runner.config.num_blocks, seed)
    tables = tables_for(runner, pages, len(prompt) + num_decode + 1)
    chunk = chunk_tokens or len(prompt)
    rows = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        rows.append(runner.forward(ForwardBatch((SequenceInput.chunk(piece, start, tables, "all"),))))
    ref = Reference(torch.cat(rows))
    token, cached = int(ref.prefill_logits[-1].argmax()), len(prompt)
    for _ in range(num_decode):
        ref.tokens.append(token)
        logits = runner.forward(ForwardBatch((SequenceInput.chunk([token], cached, tables),)))[0]
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
