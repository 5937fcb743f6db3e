"""check_finish: EOS, stop token ids, stop strings and max_tokens, in that order."""

from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.stop import FinishReason, check_finish

EOS = 2


def test_eos_stops_unless_ignored():
    params = SamplingParams(max_tokens=10)
    assert check_finish(params, EOS, 3, eos_token_ids={EOS}) is FinishReason.STOP
    assert check_finish(SamplingParams(ignore_eos=True), EOS, 3, eos_token_ids={EOS}) is None
    assert check_finish(params, 7, 3, eos_token_ids={EOS}) is None


def test_stop_token_ids_and_stop_strings_stop_even_with_ignore_eos():
    params = SamplingParams(stop_token_ids=[7, 9], ignore_eos=True)
    assert check_finish(params, 9, 1) is FinishReason.STOP
    assert check_finish(params, 5, 1, stop_string="END") is FinishReason.STOP


def test_length_at_exactly_max_tokens_and_stop_wins_a_tie():
    params = SamplingParams(max_tokens=4)
    assert check_finish(params, 5, 3) is None
    assert check_finish(params, 5, 4) == "length"
    assert check_finish(params, EOS, 4, eos_token_ids=[EOS]) == "stop"
    assert str(FinishReason.LENGTH) == "length"


def test_params_stop_and_detokenize_import_without_torch():
    """The server validates params and streams text without loading torch."""
    import subprocess
    import sys

    code = ("import sys, ctxwarden.sampling, ctxwarden.sampling.detokenize; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
