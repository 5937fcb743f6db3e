"""Every `weights=` mode on the real SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding) against fp32.

- auto keeps the file's Q4_1 / Q8_0 codes and multiplies them with fp32 activations, so a
  step small enough for the kernels (decode, short chunks) reproduces the dequantized
  fp32 model up to summation order: logits within 1e-3 (fp32 rounding over 30 layers and a
  49K vocabulary; measured ~1e-4).
- Perplexity on an Austen excerpt (512 tokens, one prefill) against the fp32 path, bounds
  from the measured values with room for other CPUs' kernels: auto and int4 (the same
  codes, prefill GEMMs on the weight expanded to fp32) within 1% (measured +0.00%), bf16
  within 1% (measured +0.09%), int8 (8-bit codes requantized from the 4-bit weights)
  within 1% (measured +0.19%). A 1% perplexity change is below what separates neighbouring llama.cpp
  quantizations of one model (Q4_0 vs Q4_1: several percent), so a mode inside it is
  not a different model; a mode that broke (a wrong scale, a swapped nibble) is off by
  orders of magnitude.
- auto-int8act (the same codes against activations rounded to int8 per group of 32, at
  every step size) within 2%: measured +0.94% on the AVX2 EPYC. The rounding is at most
  half a step of 1/127 of each group's largest value, about 0.5% of a projection's output
  (tests/runner/test_kernels.py), compounded over 211 projections; llama.cpp pays the
  same for its Q4_1 x Q8_1 dot products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxwarden.layers.linear import codes_of
from ctxwarden.spec.checkpoint import default_model_path
from ctxwarden.context.tokenizers import load_tokenizer
from ctxwarden.runner import ForwardBatch, ModelRunner, RunnerConfig, SequenceInput
from test_kernels import ext

MODES = ("auto", "bf16", "int8", "int4", "auto-int8act")
PPL_BOUND = {"auto": 0.01, "bf16": 0.01, "int8": 0.01, "int4": 0.01, "auto-int8act": 0.02}


@pytest.fixture(scope="module")
def excerpt_ids(emma_text):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_tokenizer().encode(emma_text[5000:9000])[:512]


@pytest.fixture(scope="module")
def emma_text():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for shared in (repo.parent / "shared", repo.parent.parent / "shared"):
        path = shared / "corpora" / "austen" / "emma.txt"
        if path.is_file():
            return path.read_text()
    pytest.skip("shared/corpora/austen/emma.txt is not beside this checkout")


def _runner(mode: str) -> ModelRunner:
    return ModelRunner(None, RunnerConfig(num_blocks=40, block_size=16, weights=mode))


def _perplexity(runner: ModelRunner, ids: list[int]) -> float:
    tables = (tuple(range(runner.config.num_blocks)),)
    logits = runner.forward(ForwardBatch((SequenceInput.chunk(ids, 0, tables, "all"),)))
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()


def _chunked_logits(runner: ModelRunner, ids: list[int], chunk: int) -> torch.Tensor:
    """Last-row logits of every chunk, feeding the prompt `chunk` tokens at a time."""
    tables = (tuple(range(runner.config.num_blocks)),)
    rows = [runner.forward(ForwardBatch((SequenceInput.chunk(ids[s:s + chunk], s, tables),)))[0]
            for s in range(0, len(ids), chunk)]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def fp32_runner():
    return _runner("fp32")


@pytest.fixture(scope="module")
def fp32_perplexity(fp32_runner, excerpt_ids):
    """The reference every mode's perplexity is compared with, computed once."""
    return _perplexity(fp32_runner, excerpt_ids)


@pytest.mark.slow
@pytest.mark.skipif(ext is None, reason="the quantized kernels need ext/ (make install)")
def test_auto_small_steps_reproduce_the_dequantized_fp32_model(fp32_runner, excerpt_ids):
    auto = _runner("auto")
    assert auto.model.layers[0].qkv.kind == "q4" and auto.model.lm_head.kind == "q8"
    assert auto.model.weights_bytes < fp32_runner.model.weights_bytes / 5
    ids = excerpt_ids[:96]  # 8-token chunks: every step takes the fp32 kernels
    diff = (_chunked_logits(auto, ids, 8) - _chunked_logits(fp32_runner, ids, 8)).abs().max().item()
    print(f"auto vs fp32, 12 chunks of 8 tokens: max |logit diff| {diff:.2e}")  # shown with -s
    assert diff < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_perplexity_stays_within_bound_of_fp32(fp32_perplexity, excerpt_ids, mode):
    base = fp32_perplexity
    ppl = _perplexity(_runner(mode), excerpt_ids)
    print(f"{mode}: perplexity {ppl:.3f} vs fp32 {base:.3f} ({100 * (ppl / base - 1):+.2f}%)")
    assert 5 < base < 100  # a real model on real prose, not noise
    assert abs(ppl / base - 1) < PPL_BOUND[mode]


@pytest.mark.slow
@pytest.mark.skipif(ext is None, reason="the integer kernels need ext/ (make install)")
def test_auto_int8act_keeps_auto_codes_and_stays_near_auto(excerpt_ids):
    auto, fast = _runner("auto"), _runner("auto-int8act")
    for name in ("qkv", "o", "gate_up", "down"):
        a, f = getattr(auto.model.layers[0], name), getattr(fast.model.layers[0], name)
        assert f.kind == a.kind == "q4" and f.quant.int8_activations and not a.quant.int8_activations
        assert torch.equal(codes_of(f).codes, a.quant.codes)
    assert fast.model.lm_head.kind == "q8" and fast.model.lm_head.quant.int8_activations
    # the same codes; where the kernels run from panels, a q4 projection's panels replace its
    # row-major codes, and the q8 lm_head keeps its codes beside its panels
    projections = [lw for layer in fast.model.layers for lw in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    panels = sum(lw.panels.nbytes for lw in projections if lw.panels is not None)
    dropped = sum(codes_of(lw).codes.nbytes for lw in projections if lw.panels is not None)
    head = fast.model.lm_head.panels
    assert fast.model.weights_bytes == (auto.model.weights_bytes + panels - dropped
                                        + (head.nbytes if head is not None else 0))
    if ext.has_panels():
        assert panels == sum(getattr(layer, n).quant.nbytes for layer in auto.model.layers
                             for n in ("qkv", "o", "gate_up", "down"))  # SmolLM2's N: multiples of 16
    # decode-sized steps take the integer kernels: close to auto, but not auto's numbers
    ids = excerpt_ids[:48]
    a, f = _chunked_logits(auto, ids, 4), _chunked_logits(fast, ids, 4)
    diff = (a - f).abs().max().item()
    print(f"auto-int8act vs auto, 12 chunks of 4 tokens: max |logit diff| {diff:.2e}")
    assert 1e-3 < diff < 0.1 * a.abs().max().item()
    assert (a.argmax(-1) == f.argmax(-1)).float().mean().item() >= 0.75
