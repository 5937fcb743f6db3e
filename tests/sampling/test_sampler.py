"""Sampler: greedy is argmax, seeds reproduce across batches, filters hold, draws match softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.sampler import (
    Sampler,
    SamplingRow,
    make_generator,
    prompt_logprobs,
)

SAMPLER = Sampler()


def _rows(params, num_rows, seed=0):
    return [SamplingRow(params, generator=make_generator(seed, i)) for i in range(num_rows)]


def test_greedy_is_exact_argmax_also_in_a_mixed_batch():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)) * 5
    all_greedy = SAMPLER.sample(logits, [SamplingRow(SamplingParams.greedy())] * 8)
    assert all_greedy.token_ids == logits.argmax(-1).tolist()
    mixed = [SamplingRow(SamplingParams.greedy()) if i % 2 else
             SamplingRow(SamplingParams(temperature=1.5), generator=make_generator(i))
             for i in range(8)]
    picks = SAMPLER.sample(logits, mixed).token_ids
    assert picks[1::2] == logits.argmax(-1).tolist()[1::2]


def test_random_row_without_generator_is_refused():
    with pytest.raises(ValueError, match="make_generator"):
        SamplingRow(SamplingParams(temperature=0.7))


def _decode_steps(params, seed, position, batch_size, num_steps=12, vocab=200):
    """Run a seeded request for some steps at `position` in a batch of random neighbours."""
    gen = make_generator(seed)
    logits_gen = torch.Generator().manual_seed(99)
    noise_gen = torch.Generator().manual_seed(1000 + batch_size)
    tokens = []
    for _ in range(num_steps):
        mine = torch.randn(1, vocab, generator=logits_gen) * 2
        batch = torch.randn(batch_size, vocab, generator=noise_gen) * 2
        batch[position] = mine[0]
        rows = [SamplingRow(SamplingParams(temperature=0.5 + i % 3, top_k=i % 5),
                            generator=make_generator(7 + i)) for i in range(batch_size)]
        rows[position] = SamplingRow(params, output_token_ids=tokens, generator=gen)
        tokens = tokens + [SAMPLER.sample(batch, rows).token_ids[position]]
    return tokens


def test_seeded_request_reproduces_across_batch_compositions_and_differs_by_seed():
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01,
                            frequency_penalty=0.3, seed=1234)
    alone = _decode_steps(params, seed=1234, position=0, batch_size=1)
    assert _decode_steps(params, seed=1234, position=3, batch_size=5) == alone
    assert _decode_steps(params, seed=1234, position=10, batch_size=11) == alone
    assert _decode_steps(params, seed=4321, position=0, batch_size=1) != alone


def test_samples_of_one_request_use_distinct_streams():
    logits = torch.zeros(1, 1000)
    draws = [SAMPLER.sample(logits, [SamplingRow(SamplingParams(), generator=make_generator(
        5, index))]).token_ids[0] for index in range(4)]
    assert len(set(draws)) == 4  # equal draws from a 1000-way uniform: p ~ 6e-3


def _allowed(logits, temperature, top_k, top_p, min_p):
    """Independent reference in float64: the tokens each filter may keep."""
    scaled = logits.double() / temperature
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if top_k > 0:
        kth = scaled.sort(descending=True).values[min(top_k, len(scaled)) - 1]
        allowed &= scaled >= kth
    probs = torch.where(allowed, scaled, -math.inf).softmax(-1)
    if top_p < 1.0:  # a token may stay if the mass strictly above it is below top_p
        mass_above = torch.stack([probs[probs > p].sum() for p in probs])
        allowed &= mass_above < top_p + 1e-5
    if min_p > 0.0:  # min-p is relative to the top token, so renormalising does not matter
        allowed &= probs >= min_p * probs.max() * (1 - 1e-5)
    return allowed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), vocab=st.integers(2, 64),
       temperature=st.sampled_from([0.3, 1.0, 2.5]), top_k=st.integers(-1, 10),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6]),
       min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]), ties=st.booleans())
def test_filters_never_pick_outside_the_allowed_set(seed, vocab, temperature, top_k, top_p,
                                                    min_p, ties):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:  # coarse logits create ties at the top-k / top-p boundaries
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    picks = SAMPLER.sample(logits.expand(64, vocab), _rows(params, 64, seed)).token_ids
    allowed = _allowed(logits, temperature, top_k, top_p, min_p)
    assert all(allowed[t] for t in picks), (picks, allowed.nonzero().flatten().tolist())


# Critical chi-square value for 4 degrees of freedom at p = 1e-4: a correct sampler fails
# this test once in 10,000 runs; a biased one (e.g. ignoring temperature) fails every time.
_CHI2_DF4_P1E4 = 23.51


@pytest.mark.parametrize(
    ("params", "expected_probs"),
    [
        (SamplingParams(temperature=0.7), None),
        (SamplingParams(temperature=1.0), None),
        (SamplingParams(temperature=1.3, top_k=3), "top3"),
    ],
)
def test_draws_match_softmax_with_temperature(params, expected_probs):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5])
    probs = (logits / params.temperature).softmax(-1)
    if expected_probs == "top3":  # tokens 0, 3, 1 kept, renormalised
        probs = probs * torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
        probs = probs / probs.sum()
    num_draws = 20_000
    gen = make_generator(2024)
    rows = [SamplingRow(params, generator=gen) for _ in range(num_draws)]  # one shared stream
    picks = torch.tensor(SAMPLER.sample(logits.expand(num_draws, 5), rows).token_ids)
    counts = torch.bincount(picks, minlength=5).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept].double() * num_draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < _CHI2_DF4_P1E4, (counts.tolist(), expected.tolist())


def test_biased_sampler_would_fail_the_chi_square_check():
    """Guard that the test above can fail: temperature-1 draws judged against temperature 0.7."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5])
    rows = _rows(SamplingParams(temperature=1.0), 20_000)
    counts = torch.bincount(torch.tensor(SAMPLER.sample(logits.expand(20_000, 5), rows)
                                         .token_ids), minlength=5).double()
    expected = (logits / 0.7).softmax(-1).double() * 20_000
    assert float(((counts - expected) ** 2 / expected).sum()) > _CHI2_DF4_P1E4


def test_logprobs_come_from_raw_logits_with_top_alternatives():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=4),
              SamplingParams.greedy(logprobs=0), SamplingParams(temperature=2.0)]
    rows = [SamplingRow(p, prompt_token_ids=[1, 2], output_token_ids=[3],
                        generator=make_generator(i)) for i, p in enumerate(params)]
    result = SAMPLER.sample(logits, rows)
    raw = torch.log_softmax(logits.double(), -1)
    for row, scored in enumerate(result.tokens):
        assert scored.logprob == pytest.approx(raw[row, scored.token_id].item(), abs=1e-5)
    top = raw[0].topk(4)
    assert [t.token_id for t in result[0].top_logprobs] == top.indices.tolist()
    assert [t.logprob for t in result[0].top_logprobs] == pytest.approx(top.values.tolist(),
                                                                        abs=1e-5)
    assert result[1].top_logprobs == () and result[2].top_logprobs == ()


def test_prompt_logprobs_score_each_next_token_across_chunks():
    prompt = torch.randint(0, 16, (700,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = torch.randn(700, 16, generator=torch.Generator().manual_seed(5))
    scored = prompt_logprobs(logits, prompt, num_top=2)
    raw = torch.log_softmax(logits.double(), -1)
    assert len(scored) == 699 and [s.token_id for s in scored] == prompt[1:]
    for i in (0, 511, 512, 698):  # both sides of the 512-row chunk boundary
        assert scored[i].logprob == pytest.approx(raw[i, prompt[i + 1]].item(), abs=1e-5)
        assert [t.token_id for t in scored[i].top_logprobs] == raw[i].topk(2).indices.tolist()
    with pytest.raises(ValueError, match="shape"):
        prompt_logprobs(logits[:10], prompt, num_top=0)


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError, match="num_rows=2"):
        SAMPLER.sample(torch.zeros(3, 5), [SamplingRow(SamplingParams.greedy())] * 2)


def test_top_p_on_a_flat_distribution_past_the_candidate_window():
    """3,000 near-equal tokens: top-p's cutoff lies beyond the first 1,024 candidates."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(6)) * 0.3
    params = SamplingParams(temperature=1.0, top_p=0.8)
    rows = _rows(params, 256) + [SamplingRow(SamplingParams(top_p=0.5),
                                             generator=make_generator(1))]
    picks = SAMPLER.sample(logits.expand(257, 3000), rows).token_ids
    allowed = _allowed(logits, 1.0, 0, 0.8, 0.0)
    assert 1024 < int(allowed.sum()) < 3000  # the filter is active, its cutoff deep
    assert all(allowed[t] for t in picks[:256])
    rank = logits.argsort(descending=True).argsort()
    assert max(rank[t] for t in picks[:256]) >= 1024  # the deep part is reachable too
    assert allowed[picks[256]]  # a top_p=0.5 row keeps a subset of the 0.8 set


def _greedy_all(logits):
    return SAMPLER.sample(logits, [SamplingRow(SamplingParams.greedy())] * logits.shape[0])


@pytest.mark.skipif(__import__("ctxwarden.ext", fromlist=["kernels"]).kernels() is None,
                    reason="the C++ kernels are not built")
def test_greedy_fast_path_matches_torch_on_ties_inf_and_a_vocab_sized_row():
    """The one-pass ext/ argmax + logsumexp of a decode step: the first of tied maxima (as
    torch.argmax), -inf logits (masked vocabulary) allowed, logprobs as log_softmax's in
    fp64, and a row with NaN or +inf handed to torch (whose answer it then gives)."""
    logits = torch.randn(5, 49_152, generator=torch.Generator().manual_seed(9)) * 6
    logits[1, 40_000] = logits[1, 123] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, :30_000] = -torch.inf
    logits[3, 49_151] = logits[3].max() + 2  # the last lane, past every 16-lane block
    result = _greedy_all(logits)
    raw = torch.log_softmax(logits.double(), -1)
    assert result.token_ids == logits.argmax(-1).tolist() and result.token_ids[1] == 123
    for row, scored in enumerate(result.tokens):
        assert scored.logprob == pytest.approx(raw[row, scored.token_id].item(), abs=2e-6)
    odd = logits[:2].clone()
    odd[0, 7] = torch.nan
    odd[1, 9] = torch.inf
    fallback = _greedy_all(odd)
    assert fallback.token_ids == odd.argmax(-1).tolist() == [7, 9]
    for lane in (1, 15, 17):  # a vocabulary that is not a multiple of the lanes
        small = torch.randn(2, lane, generator=torch.Generator().manual_seed(lane))
        assert _greedy_all(small).token_ids == small.argmax(-1).tolist()
