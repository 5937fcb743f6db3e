"""One API request's choices: build prompts and params per engine, submit, gather outputs.

A request with `n` choices over `P` prompts becomes P x n engine requests (choice index
p * n + j). Submission is all-or-nothing: if any choice is refused, the ones already
queued are aborted before the refusal propagates.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ctxwarden.request import StepOutput
from ctxwarden.sampling import SamplingParams
from ctxwarden.server.async_engine import AsyncEngine


STREAMING_MIN_MAX_TOKENS = 256  # a streaming-mode chat without max_tokens whose prompt fills the window


@dataclass(frozen=True)
class Job:
    """What the client asked for, independent of which model serves it."""

    is_chat: bool
    prompts: tuple  # chat: (messages as dicts,); completions: str or list[int] each
    n: int
    max_tokens: int | None
    sampling: dict  # SamplingParams fields other than max_tokens / n / seed
    seed: int | None
    prompt_param: str  # the request field a prompt error points at

    def prompt_for(self, engine: AsyncEngine, prompt_index: int) -> Any:
        """Token ids (chat: the template rendered by this engine's tokenizer) or text."""
        prompt = self.prompts[prompt_index]
        if not self.is_chat:
            return prompt
        tok = engine.tokenizer
        if tok is None or tok.chat_template is None:
            raise ValueError(f"model {engine.name!r} has no chat template; use /v1/completions")
        try:
            rendered = tok.render_chat(prompt, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise ValueError(f"the chat template rejected these messages: {e}") from e
        return tok.encode(rendered)

    def params_for(self, engine: AsyncEngine, prompt: Any, choice: int) -> SamplingParams:
        """SamplingParams of one choice; a chat without max_tokens may use the rest of the window."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            floor = STREAMING_MIN_MAX_TOKENS if engine.is_streaming else 1  # streaming: past the window
            max_tokens = max(floor, engine.max_model_len - len(prompt)) if self.is_chat else 16
        seed = None if self.seed is None else self.seed + choice  # choices differ, reproducibly
        return SamplingParams(max_tokens=max_tokens, seed=seed, **self.sampling)


@dataclass
class Choice:
    """The state of one choice as its StepOutputs arrive."""

    index: int
    prompt_index: int
    request_id: str
    num_prompt_tokens: int
    max_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # ScoredToken
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, out: StepOutput) -> None:
        """Fold one StepOutput into this choice."""
        now = time.monotonic()
        if out.new_token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
            self.error = out.error
            self.finished_s = now


@dataclass
class Generation:
    """The submitted choices of one API request on one engine."""

    engine: AsyncEngine
    choices: list[Choice]
    outputs: asyncio.Queue
    arrival_s: float

    @property
    def is_finished(self) -> bool:
        return all(c.is_finished for c in self.choices)

    async def next(self) -> tuple[Choice, StepOutput]:
        """The next StepOutput of any choice, folded into its choice."""
        out = await self.outputs.get()
        choice = next(c for c in self.choices if c.request_id == out.request_id)
        choice.absorb(out)
        return choice, out

    def abort_unfinished(self) -> int:
        """Abort every choice still running (client gone, or shutdown); returns how many."""
        live = [c for c in self.choices if not c.is_finished]
        for c in live:
            self.engine.abort(c.request_id)
        return len(live)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens, counted once per prompt (not per choice)."""
        return sum(c.num_prompt_tokens for c in self.choices if c.index % self._n == 0)

    @property
    def num_cached_tokens(self) -> int:
        """Prefix-cache hits of each prompt's first choice (later choices hit the first's blocks)."""
        return sum(c.num_cached_tokens for c in self.choices if c.index % self._n == 0)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_booked_tokens(self) -> int:
        """What the request may use at most: every choice's prompt and max_tokens."""
        return sum(c.num_prompt_tokens + c.max_tokens for c in self.choices)

    @property
    def num_used_tokens(self) -> int:
        """What it used: every choice's prompt and generated tokens."""
        return sum(c.num_prompt_tokens + len(c.token_ids) for c in self.choices)

    @property
    def max_prompt_tokens(self) -> int:
        return max(c.num_prompt_tokens for c in self.choices)

    @property
    def _n(self) -> int:
        return len(self.choices) // len({c.prompt_index for c in self.choices})


async def submit(engine: AsyncEngine, job: Job, api_id: str, namespace: str, share=None) -> Generation:
    """Queue every choice of `job` on `engine`; all or nothing (refusals propagate)."""
    gen = Generation(engine, [], asyncio.Queue(), time.monotonic())
    try:
        for p in range(len(job.prompts)):
            prompt = job.prompt_for(engine, p)
            for j in range(job.n):
                index = p * job.n + j
                params = job.params_for(engine, prompt, j)
                choice = Choice(index, p, f"{api_id}-{index}", num_prompt_tokens=0, max_tokens=params.max_tokens)
                gen.choices.append(choice)  # before the await: a cancelled submit is aborted too
                admitted = await engine.submit(prompt, params, choice.request_id, namespace, gen.outputs, share)
                choice.num_prompt_tokens = admitted.num_prompt_tokens
    except BaseException:
        gen.abort_unfinished()
        raise
    return gen
