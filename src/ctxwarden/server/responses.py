"""Finished and streamed choices in the OpenAI wire format (chat and legacy completions)."""

from __future__ import annotations

import json

from ctxwarden.server.generation import Choice, Generation
from ctxwarden.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                       ChatMessageOut, ChatTokenLogprob, CompletionChoice,
                                       CompletionLogprobs, CompletionResponse,
                                       PromptTokensDetails, TopLogprob, Usage)


def usage_of(gen: Generation) -> Usage:
    """Token counts of a whole request; cached_tokens is what the prefix cache served."""
    prompt, completion = gen.num_prompt_tokens, gen.num_completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.num_cached_tokens))


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def chat_logprobs(tokenizer, scored: list, top_k: int) -> ChatLogprobs:
    """`logprobs.content` of a chat choice: each token, its logprob and top alternatives."""
    content = []
    for s in scored:
        text = _token_text(tokenizer, s.token_id)
        tops = [TopLogprob(token=(t := _token_text(tokenizer, a.token_id)), logprob=a.logprob,
                           bytes=list(t.encode())) for a in s.top_logprobs[:top_k]]
        content.append(ChatTokenLogprob(token=text, logprob=s.logprob, bytes=list(text.encode()),
                                        top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, scored: list, top_k: int, text_offset: int = 0) -> CompletionLogprobs:
    """Legacy `logprobs` of a completion choice: tokens, logprobs, top dicts, text offsets."""
    out = CompletionLogprobs()
    for s in scored:
        text = _token_text(tokenizer, s.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(s.logprob)
        out.top_logprobs.append({_token_text(tokenizer, a.token_id): a.logprob for a in s.top_logprobs[:top_k]})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def chat_response(gen: Generation, api_id: str, created: int, model: str, top_k: int | None) -> ChatCompletionResponse:
    """The non-streamed chat completion."""
    tok = gen.engine.tokenizer
    choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                          logprobs=chat_logprobs(tok, c.logprobs, top_k) if top_k is not None else None)
               for c in gen.choices]
    return ChatCompletionResponse(id=api_id, created=created, model=model, choices=choices, usage=usage_of(gen))


def completion_response(gen: Generation, api_id: str, created: int, model: str,
                        top_k: int | None) -> CompletionResponse:
    """The non-streamed text completion."""
    tok = gen.engine.tokenizer
    choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                logprobs=completion_logprobs(tok, c.logprobs, top_k) if top_k is not None else None)
               for c in gen.choices]
    return CompletionResponse(id=api_id, created=created, model=model, choices=choices, usage=usage_of(gen))


def sse(payload) -> str:
    """One server-sent event carrying a pydantic model or a dict as JSON."""
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


def chat_role_chunk(api_id: str, created: int, model: str, index: int) -> ChatCompletionChunk:
    """The first chunk of a streamed chat choice: the assistant role, empty content."""
    return ChatCompletionChunk(id=api_id, created=created, model=model, choices=[
        ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])


def chat_chunk(gen: Generation, choice: Choice, out, api_id: str, created: int, model: str,
               top_k: int | None) -> ChatCompletionChunk:
    """A streamed chat delta for one StepOutput."""
    lp = chat_logprobs(gen.engine.tokenizer, list(out.new_logprobs), top_k) if top_k is not None else None
    delta = ChatDelta(content=out.text_delta) if out.text_delta or not out.finished else ChatDelta()
    return ChatCompletionChunk(id=api_id, created=created, model=model, choices=[
        ChatChunkChoice(index=choice.index, delta=delta, logprobs=lp,
                        finish_reason=choice.finish_reason if out.finished else None)])


def completion_chunk(gen: Generation, choice: Choice, out, api_id: str, created: int, model: str,
                     top_k: int | None) -> CompletionResponse:
    """A streamed text-completion delta for one StepOutput."""
    lp = None
    if top_k is not None:
        lp = completion_logprobs(gen.engine.tokenizer, list(out.new_logprobs), top_k,
                                 text_offset=len(choice.text) - len(out.text_delta))
    return CompletionResponse(id=api_id, created=created, model=model, choices=[
        CompletionChoice(index=choice.index, text=out.text_delta, logprobs=lp,
                         finish_reason=choice.finish_reason if out.finished else None)])


def usage_chunk(gen: Generation, api_id: str, created: int, model: str, is_chat: bool):
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    cls = ChatCompletionChunk if is_chat else CompletionResponse
    return cls(id=api_id, created=created, model=model, choices=[], usage=usage_of(gen))
