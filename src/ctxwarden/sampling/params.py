"""Per-request sampling parameters: one frozen, validated `SamplingParams` per request.

Semantics follow the OpenAI API and vLLM, so a server can map request fields one to one:
- `temperature` 0 means greedy (exact argmax); values below `GREEDY_TEMPERATURE` also count
  as greedy, because dividing logits by ~1e-6 overflows fp32 into inf/NaN.
- `top_k` 0 or -1 is off; `top_p` 1.0 is off; `min_p` 0.0 is off.
- `repetition_penalty` has Hugging Face semantics (over prompt + output tokens); presence and
  frequency penalties have OpenAI semantics (over output tokens only).
- `logprobs` / `prompt_logprobs`: how many top alternatives to report per token (0 = only the
  chosen token's own logprob), up to `MAX_LOGPROBS`.

Every invalid value raises `InvalidSamplingParams` (a ValueError) naming the field, the value
and the accepted range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from ctxwarden.errors import InvalidSamplingParams

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is treated as greedy
MAX_LOGPROBS = 20  # the OpenAI API's own cap on top_logprobs
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties is [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn one request's logits into tokens, and when to stop.

    Lists given for `stop` / `stop_token_ids` are normalised to tuples (a single string for
    `stop` becomes a one-element tuple), so the object stays hashable and immutable.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, low=1, accepted="an integer >= 1")
        _check_int("n", self.n, low=1, accepted="an integer >= 1")
        _check_float("temperature", self.temperature, 0.0, math.inf, "a number >= 0 (0 = greedy)")
        _check_top_k(self.top_k)
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1] (1 = off)", open_low=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1] (0 = off)")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                     "a number > 0 (1 = off)", open_low=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY,
                         f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS,
                           accepted=f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None:
            _check_int("seed", self.seed, accepted="None or an integer")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(name, getattr(self, name), "True or False")

    @classmethod
    def greedy(cls, max_tokens: int = 16, **overrides: Any) -> SamplingParams:
        """Greedy decoding (temperature 0, no filters): the exact argmax at every step."""
        return cls(max_tokens=max_tokens, temperature=0.0, **overrides)

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax of the (penalised) logits, with no randomness."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any repetition / presence / frequency penalty changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering is on (top_k >= 1)."""
        return self.top_k >= 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, low: int | None = None, high: int | None = None,
               accepted: str) -> None:
    if not _is_int(value):
        raise InvalidSamplingParams(name, value, accepted)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidSamplingParams(name, value, accepted)


def _check_float(name: str, value: object, low: float, high: float, accepted: str,
                 open_low: bool = False) -> None:
    # bool is an int subclass: True as a temperature is almost certainly a bug upstream.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidSamplingParams(name, value, accepted)
    too_low = value <= low if open_low else value < low
    if too_low or value > high or math.isinf(value):
        raise InvalidSamplingParams(name, value, accepted)


def _check_top_k(value: object) -> None:
    accepted = "0 or -1 (off), or an integer >= 1"
    if not _is_int(value) or value < -1:
        raise InvalidSamplingParams("top_k", value, accepted)


def _normalise_stop(stop: object) -> tuple[str, ...]:
    items: Iterable[object] = (stop,) if isinstance(stop, str) else (stop or ())
    accepted = "a non-empty string or a list of non-empty strings"
    if not isinstance(items, (tuple, list)) or not all(isinstance(s, str) and s for s in items):
        raise InvalidSamplingParams("stop", stop, accepted)
    return tuple(items)


def _normalise_token_ids(ids: object) -> tuple[int, ...]:
    accepted = "a list of token ids (integers >= 0)"
    if not isinstance(ids, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise InvalidSamplingParams("stop_token_ids", ids, accepted)
    return tuple(ids)
