"""SamplingParams: defaults, normalisation, and errors that name field, range and value."""

import pytest

from ctxwarden.errors import InvalidSamplingParams
from ctxwarden.sampling.params import SamplingParams


def test_defaults_and_greedy_constructor():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    assert not params.is_greedy and not params.has_penalties
    greedy = SamplingParams.greedy(7)
    assert greedy.is_greedy and greedy.max_tokens == 7 and greedy.temperature == 0.0


def test_stop_and_stop_token_ids_are_normalised_to_tuples():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)
    hash(SamplingParams(stop=["x"], stop_token_ids=[1]))  # frozen and hashable


@pytest.mark.parametrize(
    ("field", "value", "range_text"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1"),
        ("top_k", 1.5, "-1"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", True, ">= 1"),
        ("n", 0, ">= 1"),
        ("repetition_penalty", 0.0, "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("logprobs", 21, "[0, 20]"),
        ("logprobs", -1, "[0, 20]"),
        ("prompt_logprobs", 100, "[0, 20]"),
        ("seed", 1.5, "integer"),
        ("stop", [""], "non-empty string"),
        ("stop", [3], "non-empty string"),
        ("stop_token_ids", [-1], ">= 0"),
        ("ignore_eos", 1, "True or False"),
    ],
)
def test_invalid_values_name_field_range_and_value(field, value, range_text):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"'{field}'" in message and range_text in message and repr(value) in message
    assert isinstance(info.value, InvalidSamplingParams) and info.value.field == field


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=0), dict(top_k=-1), dict(top_k=0), dict(top_k=50), dict(top_p=1),
     dict(min_p=1.0), dict(presence_penalty=-2, frequency_penalty=2), dict(logprobs=0),
     dict(logprobs=20), dict(seed=-5), dict(seed=2**70), dict(repetition_penalty=0.5)],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)
