"""Penalties change logits exactly as the formulas say (expected values computed by hand)."""

import pytest
import torch

from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.penalties import apply_penalties
from ctxwarden.sampling.sampler import Sampler, SamplingRow

LOGITS = torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    params = SamplingParams(repetition_penalty=2.0)
    # token 1 in the prompt, tokens 2 and 3 in the output; 0 and 4 unseen
    out = apply_penalties(LOGITS, params, prompt_token_ids=[1], output_token_ids=[2, 3, 3])
    assert out.tolist() == [2.0, -2.0, 0.25, -6.0, 4.0]
    assert LOGITS.tolist() == [2.0, -1.0, 0.5, -3.0, 4.0]  # input untouched


def test_frequency_and_presence_penalties_count_output_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_penalties(LOGITS, params, prompt_token_ids=[0, 1], output_token_ids=[4, 4, 4, 2])
    # token 4: 4 - 0.5*3 - 1 = 1.5; token 2: 0.5 - 0.5*1 - 1 = -1.0; prompt tokens untouched
    assert out.tolist() == [2.0, -1.0, -1.0, -3.0, 1.5]


def test_negative_presence_penalty_encourages_and_all_three_compose():
    params = SamplingParams(repetition_penalty=1.25, frequency_penalty=-0.25,
                            presence_penalty=-2.0)
    out = apply_penalties(LOGITS, params, prompt_token_ids=[3], output_token_ids=[0, 0])
    # token 0: 2 / 1.25 = 1.6, then + 0.25*2 + 2 = 4.1; token 3 (prompt): -3 * 1.25 = -3.75
    assert out.tolist() == pytest.approx([4.1, -1.0, 0.5, -3.75, 4.0], abs=1e-6)


def test_greedy_sampling_sees_the_penalised_logits_but_reports_raw_logprobs():
    params = SamplingParams.greedy(repetition_penalty=4.0)
    row = SamplingRow(params, prompt_token_ids=[], output_token_ids=[4])
    result = Sampler().sample(LOGITS.unsqueeze(0), [row])
    assert result.token_ids == [0]  # 4.0 / 4 = 1.0 < 2.0
    assert result[0].logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[0].item(), abs=1e-6)


def test_out_of_vocabulary_ids_are_refused():
    with pytest.raises(ValueError, match="outside \\[0, 5\\)"):
        apply_penalties(LOGITS, SamplingParams(presence_penalty=1.0), [], [5])
