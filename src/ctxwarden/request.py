"""Hand-off types between the engine's stages: a request's state and what a step emits.

No torch here: the scheduler and the block manager read these. The sampler's per-request
state (generator, detokenizer) hangs off `Request.sampling_state`, owned by the engine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    """Why a request ended. Values are the OpenAI `finish_reason` strings where one exists."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the model window, in non-sink mode)
    ABORT = "abort"  # the caller (or a disconnected client) aborted it
    ERROR = "error"  # the step failed for this request; its blocks are released all the same

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (or only prefix-cached ones after preemption)
    RUNNING = "running"  # holds blocks, scheduled every step
    SWAPPED = "swapped"  # preempted to host memory, holds no device blocks
    FINISHED = "finished"


@dataclass(frozen=True)
class TenantShare:
    """A tenant's claim on the engine: its weight in fair sharing and its own caps.

    `name` is for messages only; the scheduler keys tenants by `Request.namespace`.
    """

    name: str = "default"
    weight: float = 1.0
    max_running: int | None = None  # its requests beyond this wait (others are not held up)
    max_waiting: int | None = None  # its requests beyond this are refused (TenantLimitExceeded)

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {self.weight}")
        for name in ("max_running", "max_waiting"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"tenant {name} must be >= 1, got {value}")


@dataclass
class Request:
    """The engine's mutable state of one sequence (one choice of one API request)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # ctxwarden.sampling.SamplingParams
    namespace: str = ""  # the tenant: salts the prefix cache
    priority: int = 0  # lower runs first; ties go to the earlier arrival
    reads_prefix_cache: bool = True  # False: compute every prompt token (prompt logprobs)
    share: TenantShare = field(default_factory=TenantShare)
    # more prefix-cache salt: KV that only this kind of request may share (length-dependent
    # RoPE past its trained length rotates keys by the prompt's length)
    cache_keys: tuple[bytes, ...] = ()
    arrival_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache on admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    output_text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    sampling_state: Any = None  # generator, detokenizer: created by the engine

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request (streamed to the caller)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: tuple = ()
    stop_reason: str | int | None = None
    error: str | None = None
