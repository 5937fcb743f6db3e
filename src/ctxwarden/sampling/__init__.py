"""Sampling stage: logits -> tokens (sampler), stop decisions (stop), tokens -> text (detokenize).

The sampler needs torch; params, stop and detokenize do not (the server can validate
SamplingParams and stream text without importing torch).
"""

from ctxwarden.sampling.detokenize import IncrementalDetokenizer, TokenDecoder
from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.stop import FinishReason, check_finish

__all__ = [
    "FinishReason",
    "IncrementalDetokenizer",
    "SamplingParams",
    "TokenDecoder",
    "check_finish",
]
