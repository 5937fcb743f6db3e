"""When does a sequence finish? One decision per step, after its new token is known.

Order of checks, as vLLM does: EOS (unless ignore_eos), a stop token id, a stop string
(found by the detokenizer), then max_tokens, then the model's window (prompt + outputs
reaching `max_model_len`; admission makes this rare, and sink mode has no such limit). A
stop wins over length when both happen on the same step, since the model did choose to stop.
"""

from __future__ import annotations

from typing import Collection

from ctxwarden.request import FinishReason
from ctxwarden.sampling.params import SamplingParams


def check_finish(params: SamplingParams, last_token_id: int, num_output_tokens: int,
                 eos_token_ids: Collection[int] = (),
                 stop_string: str | None = None, num_tokens: int = 0,
                 max_model_len: int | None = None) -> FinishReason | None:
    """Decide whether the sequence ends after its newest token; None means keep going.

    `num_output_tokens` counts the newest token; `eos_token_ids` are the model's EOS ids
    (several for some chat models); `stop_string` is the detokenizer's matched stop string;
    `num_tokens` is prompt + outputs, checked against `max_model_len` (None: unbounded).
    """
    if not params.ignore_eos and last_token_id in eos_token_ids:
        return FinishReason.STOP
    if last_token_id in params.stop_token_ids or stop_string is not None:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    if max_model_len is not None and num_tokens >= max_model_len:
        return FinishReason.LENGTH  # the window is full
    return None
