"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

The request models are the schema /openapi.json publishes; their bounds are the same as
SamplingParams' (which validates again, so a value that slips past here still becomes a
400 naming the parameter). Responses follow the OpenAI wire format field for field.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request: each is a sequence in the engine
MAX_TOP_LOGPROBS = 20  # the OpenAI API's own cap
MAX_STOP_CHARS = 256  # one stop string (the detokenizer scans for each on every token)
MAX_TOKENS = 1 << 20  # a bound for the schema; the engine refuses past the model's window
MAX_USER_CHARS = 256

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=4)], None]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class StreamOptions(BaseModel):
    """`stream_options`: with include_usage, a last chunk carries the usage."""

    include_usage: bool = False


OnOverflow = Literal["error", "truncate-head", "truncate-middle", "keep-tail-semantic", "fallback"]


class CtxwardenOptions(BaseModel):
    """The `ctxwarden` extension field (openai client: `extra_body={"ctxwarden": {...}}`)."""

    model_config = ConfigDict(extra="forbid")

    on_overflow: OnOverflow | None = None  # None: the server's --on-overflow


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    # Extensions (vLLM names), off by default.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    ctxwarden: CtxwardenOptions | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1, max_length=MAX_N)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class TextPart(BaseModel):
    """A text part of a message's content array."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation; content parts are joined into one text."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    @property
    def text(self) -> str:
        """The message content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


# --- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ctxwarden"
    context_window: int  # the longest prompt + completion admitted (max_model_len)
    # ctxwarden's own fields: what the model attends to (as the x-context-* headers say)
    context_mode: Literal["full", "streaming"] = "full"
    model_window: int | None = None  # the trained window, x the RoPE scaling factor if any
    attention_window: int | None = None  # streaming: sink + rolling-window tokens attended
    rope_scaling: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    ctxwarden: dict | None = None  # the overflow report (server/overflow.py)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    ctxwarden: dict | None = None  # the overflow report (server/overflow.py)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
