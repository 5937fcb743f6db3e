"""Continuous batching: sequences of different lengths share one forward, and a prefill can
join a step where others decode; every sequence's logits still match its own HF run."""

from __future__ import annotations

import pytest
import torch

from ctxwarden.runner import ForwardBatch, SequenceInput
from runner_parity import TOL, PageAllocator, hf_model, hf_reference, make_runner, prompt_ids, tables_for

NUM_DECODE = 32


class Seq:
    """One test sequence: its prompt, its HF reference, its tables and its progress."""

    def __init__(self, runner, pages, ref_model, length: int, seed: int):
        self.prompt = prompt_ids(length, 512, seed)
        self.ref = hf_reference(ref_model, self.prompt, NUM_DECODE)
        self.tables = tables_for(runner, pages, length + NUM_DECODE + 1)
        self.cached, self.step, self.next_token = 0, 0, None

    def prefill_input(self) -> SequenceInput:
        return SequenceInput.chunk(self.prompt, 0, self.tables, "all")

    def decode_input(self) -> SequenceInput:
        return SequenceInput.chunk([self.next_token], self.cached, self.tables)

    def check_prefill(self, logits: torch.Tensor) -> float:
        diff = (logits - self.ref.prefill_logits).abs().max().item()
        self.cached, self.next_token = len(self.prompt), int(logits[-1].argmax())
        assert self.next_token == self.ref.tokens[0]
        return diff

    def check_decode(self, logits: torch.Tensor) -> float:
        diff = (logits - self.ref.decode_logits[self.step]).abs().max().item()
        self.step, self.cached, self.next_token = self.step + 1, self.cached + 1, int(logits.argmax())
        assert self.next_token == self.ref.tokens[self.step]
        return diff


def _split(logits: torch.Tensor, inputs: list[SequenceInput]) -> list[torch.Tensor]:
    return list(torch.split(logits, [len(i.logits_rows) for i in inputs]))


@pytest.mark.parametrize("arch,options", [("llama", {}), ("gemma2", {"sliding_window": 24}),
                                          ("mistral", {"sliding_window": 24})])
def test_mixed_lengths_in_one_forward_then_batched_decode(tiny_model, arch, options):
    model_dir = tiny_model(arch, **options)
    ref_model = hf_model(model_dir)
    runner = make_runner(model_dir, 16, 100 + NUM_DECODE + 1, num_seqs=4)
    pages = PageAllocator(runner.config.num_blocks, seed=1)
    seqs = [Seq(runner, pages, ref_model, n, seed) for seed, n in enumerate((1, 17, 100))]
    late = Seq(runner, pages, ref_model, 40, seed=9)  # joins mid-way with a prefill
    inputs = [s.prefill_input() for s in seqs]
    diffs = [s.check_prefill(lg) for s, lg in zip(seqs, _split(runner.forward(ForwardBatch(tuple(inputs))), inputs))]
    for step in range(NUM_DECODE):
        active = [s for s in seqs + [late] if s.cached and s.step < NUM_DECODE]
        inputs = [s.decode_input() for s in active]
        joining = step == 5
        if joining:
            inputs.append(late.prefill_input())  # a mixed step: 3 decodes + 1 prefill
        outs = _split(runner.forward(ForwardBatch(tuple(inputs))), inputs)
        diffs += [s.check_decode(lg[0]) for s, lg in zip(active, outs)]
        if joining:
            diffs.append(late.check_prefill(outs[-1]))
    assert max(diffs) < TOL, f"max |logit diff| {max(diffs):.2e}"
    assert all(s.step == NUM_DECODE for s in seqs)


def test_page_copied_out_and_back_to_another_page_keeps_logits(tiny_model):
    """Swap: pages read out of the pool and written into other pages (a new block table)
    give the same decode logits as the original pages."""
    model_dir = tiny_model("llama")
    runner = make_runner(model_dir, 16, 64, num_seqs=2)
    prompt = prompt_ids(40, 512)
    table = (tuple(range(3)),)
    runner.forward(ForwardBatch((SequenceInput.chunk(prompt, 0, table),)))
    step = ForwardBatch((SequenceInput.chunk([7], 40, table),))
    copies = [runner.kv_cache.read_page(b) for b in table[0]]
    moved = (tuple(range(3, 6)),)
    for b, page in zip(moved[0], copies):
        runner.kv_cache.write_page(b, page)
    assert copies[0].nbytes == runner.layout.page_bytes
    expected = runner.forward(step)
    got = runner.forward(ForwardBatch((SequenceInput.chunk([7], 40, moved),)))
    assert torch.equal(expected, got)
