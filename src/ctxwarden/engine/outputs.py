"""Output processing: one step's logits and what was scheduled -> that step's StepOutputs.

    for each scheduled sequence, in batch order (its logits rows are contiguous):
        rows past the last scored prompt position -> prompt logprobs (when asked for)
        its last row, when it is sampled          -> the sampler picks a token
    each sampled token -> logprobs, detokenized delta, stop / length / window check
                       -> a finished request is handed to `finish` (blocks released now)

The processor also decides, before the forward, which logits rows each sequence needs
(`logits_for`): the runner returns exactly those, and `SequenceInput.logits_rows` is then
the one record of them; nothing is re-derived after the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from ctxwarden.request import FinishReason, Request, StepOutput
from ctxwarden.runner.inputs import ForwardBatch, SequenceInput
from ctxwarden.sampling import SamplingParams
from ctxwarden.sampling.detokenize import IncrementalDetokenizer
from ctxwarden.sampling.sampler import (Sampler, SamplingRow, ScoredToken, make_generator,
                                        prompt_logprobs)
from ctxwarden.sampling.stop import check_finish
from ctxwarden.scheduler import ScheduledSeq


@dataclass
class SamplingState:
    """Per-request state the sampler and detokenizer keep across steps."""

    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None


class OutputProcessor:
    """Turns logits into tokens, text and StepOutputs; ends requests that are done.

    `finish(request, reason)` is the engine's release: it is called the moment a request
    ends, before its StepOutput is built, so the output reports it finished.
    """

    def __init__(self, tokenizer, eos_token_ids: Collection[int], max_model_len: int | None,
                 finish: Callable[[Request, FinishReason], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len  # None: sink mode, no window limit
        self.sampler = Sampler()
        self._finish = finish
        self.num_generated_tokens = 0

    # --- before the step ------------------------------------------------------------------

    def start(self, req: Request) -> None:
        """Give a new request its random stream and detokenizer."""
        params = req.params
        req.sampling_state = SamplingState(
            None if params.is_greedy else make_generator(params.seed),
            self._detokenizer(req.prompt_token_ids, params))

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer.backend, prompt_ids,
                                      skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def sequence_input(self, s: ScheduledSeq) -> SequenceInput:
        """The runner's input for one scheduled chunk, asking for the logits rows it needs."""
        req, start = s.request, s.request.num_computed_tokens
        wants = _wants_prompt_logprobs(req, start, s.num_new_tokens)
        logits = "all" if wants else ("last" if s.is_sampled else "none")
        return SequenceInput.chunk(req.all_token_ids[start:start + s.num_new_tokens], start,
                                   s.block_tables.page_ids(), logits, num_prompt_tokens=req.num_prompt_tokens)

    # --- after the step -------------------------------------------------------------------

    def process(self, scheduled: Sequence[ScheduledSeq], batch: ForwardBatch,
                logits: torch.Tensor) -> list[StepOutput]:
        """Prompt logprobs, sampling, detokenizing and stops for one step, in batch order.

        `logits` holds, sequence after sequence, the rows `batch` asked for.
        """
        sampled, rows, at = [], [], 0
        for s, seq in zip(scheduled, batch.sequences):
            n_rows = len(seq.logits_rows)
            if n_rows > 1 or (n_rows == 1 and not s.is_sampled):
                self._record_prompt_logprobs(s.request, seq, logits[at:at + n_rows])
            if s.is_sampled:
                sampled.append(s.request)
                rows.append(at + n_rows - 1)
            at += n_rows
        if not sampled:
            return []
        if rows == list(range(logits.shape[0])):  # a decode step: every row sampled, no copy
            return self._sample(sampled, logits)
        return self._sample(sampled, logits[rows])

    def _record_prompt_logprobs(self, req: Request, seq: SequenceInput, rows: torch.Tensor) -> None:
        """Logprobs of prompt tokens not scored yet, under the logits of the positions before.

        Row i holds the logits of position start + i, which predict token start + i + 1.
        """
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # the first prompt token has no context
        start = seq.num_computed_tokens
        first = len(req.prompt_logprobs) - 1  # the next position whose logits score a token
        targets = req.prompt_token_ids[first + 1:start + rows.shape[0] + 1]
        if targets:
            window = req.prompt_token_ids[first:first + 1 + len(targets)]
            rows = rows[first - start:first - start + len(targets)]
            req.prompt_logprobs += prompt_logprobs(rows, window, req.params.prompt_logprobs)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.sampling_state.generator)
                for r in reqs]
        result = self.sampler.sample(logits, rows)
        return [self._accept(r, result[i]) for i, r in enumerate(reqs)]

    def _accept(self, req: Request, scored: ScoredToken) -> StepOutput:
        """Append one sampled token; detokenize; end the request if it is done."""
        token = scored.token_id
        req.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
        if req.params.logprobs is not None:
            req.logprobs.append(scored)
        detok = req.sampling_state.detokenizer
        delta = detok.push(token) if detok is not None else ""
        stop_string = detok.stop_string if detok is not None else None
        reason = check_finish(req.params, token, len(req.output_token_ids), self.eos_token_ids,
                              stop_string, req.num_tokens, self.max_model_len)
        if reason is not None:
            if detok is not None and not detok.is_finished:
                delta += detok.flush()
            req.stop_reason = stop_string or (token if token in req.params.stop_token_ids else None)
            self._finish(req, reason)
        req.output_text += delta
        return output_of(req, (token,), delta, (scored,) if req.params.logprobs is not None else ())


def output_of(req: Request, tokens=(), delta: str = "", logprobs=(), error: str | None = None) -> StepOutput:
    """The StepOutput of `req` as it stands now (finished or not)."""
    return StepOutput(req.request_id, tuple(tokens), delta, req.is_finished, req.finish_reason,
                      req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens,
                      tuple(logprobs), req.stop_reason, error)


def _wants_prompt_logprobs(req: Request, start: int, num_new_tokens: int) -> bool:
    """Whether a chunk [start, start + n) holds the next position whose logits score a token.

    Scores are recorded in order. A recompute after preemption (or a partial prefix hit on
    the request's own blocks) can start before or at that position: the chunk then scores
    from it on; a chunk wholly before it scores nothing again.
    """
    if req.params.prompt_logprobs is None:
        return False
    first = len(req.prompt_logprobs) - 1 if req.prompt_logprobs is not None else 0
    return start <= first < min(start + num_new_tokens, req.num_prompt_tokens - 1)
