"""Make a prompt fit a window: budget = window - max_tokens - template overhead.

A prompt is plain text or a list of chat messages. Its parts (the text, or each message's
content) are what a strategy may shorten; the overhead (chat template, BOS) is counted
exactly by rendering the template and re-counting. Strategies:

  error               raise ContextLengthExceeded with the numbers
  truncate-head       drop the start of the longest part (keep its end)
  truncate-middle     keep the start and the end of the longest part
  truncate-tail       drop the end of the longest part
  keep-tail-semantic  keep the system prompt and the final instruction/question, drop whole
                      sentences elsewhere, least relevant to the question first, ranked by
                      `ranker` (lexical | dense | hybrid; default hybrid when the embedding
                      model is installed, else lexical); "[...]" marks each cut
  chunk               split the longest part into pieces that each fit (for map-reduce)

Invariant: the result is re-counted as the model will see it (template rendered, special
tokens parsed) and prompt_tokens + max_tokens <= window_tokens. When a re-count comes out
over (BPE differs at a cut, a dropped message changes the template), the budget is lowered
by the excess and the strategy runs again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ctxwarden.context import semantic
from ctxwarden.context.semantic import RemovedSpan
from ctxwarden.context.chunk import Chunk, chunk
from ctxwarden.context.rank import resolve_ranker
from ctxwarden.context.tokenizers import ChatMessage, Tokenizer, as_messages
from ctxwarden.context.truncate import TRUNCATIONS, Truncator
from ctxwarden.errors import ContextLengthExceeded

STRATEGIES = ("error", *TRUNCATIONS, "keep-tail-semantic", "chunk")
MAX_REFITS = 16  # re-count rounds; each lowers the budget by the measured excess


@dataclass(frozen=True)
class FitResult:
    """What `fit` returns: the fitted prompt (or its chunks) and the numbers behind it."""

    strategy: str
    window_tokens: int
    max_tokens: int
    overhead_tokens: int  # chat template / BOS tokens around the parts
    budget_tokens: int  # window - max_tokens - overhead: what the parts may use
    original_tokens: int  # the prompt as given, template included
    prompt_tokens: int  # the fitted prompt, re-counted (for chunk: the largest piece's prompt)
    text: str | None = None
    messages: list[ChatMessage] | None = None
    chunks: list[Chunk] = field(default_factory=list)
    chunk_part: int | None = None  # for chunk: which message's content each chunk replaces
    is_overhead_exact: bool = True
    ranker: str | None = None  # keep-tail-semantic: the ranker that ran (None: it fitted, nothing ranked)
    removed: list[RemovedSpan] = field(default_factory=list)  # keep-tail-semantic: what was cut, where

    @property
    def was_changed(self) -> bool:
        """True when the strategy had to shorten or split the prompt."""
        return self.prompt_tokens != self.original_tokens or bool(self.chunks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = {k: getattr(self, k) for k in ("strategy", "window_tokens", "max_tokens", "overhead_tokens",
                                              "budget_tokens", "original_tokens", "prompt_tokens",
                                              "chunk_part", "is_overhead_exact", "ranker", "text")}
        out["was_changed"] = self.was_changed
        out["messages"] = [{"role": m.role, "content": m.content} for m in self.messages] if self.messages else None
        out["chunks"] = [c.to_dict() for c in self.chunks]
        out["removed"] = [vars(r) for r in self.removed]
        return out


class _Prompt:
    """The prompt as parts plus a way to count any variant of those parts exactly."""

    def __init__(self, prompt: str | Sequence[ChatMessage | dict], tokenizer: Tokenizer, add_generation_prompt: bool):
        self.tokenizer, self.add_generation_prompt = tokenizer, add_generation_prompt
        self.messages = None if isinstance(prompt, str) else as_messages(prompt)
        self.parts = [prompt] if self.messages is None else [m.content for m in self.messages]
        self.is_exact = tokenizer.is_chat_count_exact if self.messages is not None else tokenizer.is_exact

    def build(self, parts: Sequence[str]) -> str | list[ChatMessage]:
        """The prompt with these parts; an emptied non-final message is dropped."""
        if self.messages is None:
            return parts[0]
        last = len(parts) - 1
        return [ChatMessage(m.role, p) for i, (m, p) in enumerate(zip(self.messages, parts))
                if p or i == last or m.role == "system"]

    def count(self, parts: Sequence[str]) -> int:
        """Exact prompt tokens of the prompt built from `parts`."""
        built = self.build(parts)
        if isinstance(built, str):
            return self.tokenizer.count_prompt(built)
        return self.tokenizer.count_messages(built, self.add_generation_prompt)


def fit(prompt: str | Sequence[ChatMessage | dict], window_tokens: int, max_tokens: int, tokenizer: Tokenizer,
        strategy: str = "error", add_generation_prompt: bool = True, ranker: str | None = None) -> FitResult:
    """Fit `prompt` (text or chat messages) into window_tokens - max_tokens (see module doc).

    `ranker` (lexical, dense, hybrid; None = hybrid when the embedding model is installed,
    else lexical) is used by keep-tail-semantic only; the result's `ranker` says which ran.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    if ranker is not None and strategy != "keep-tail-semantic":
        raise ValueError(f"a ranker ({ranker!r}) only applies to the keep-tail-semantic strategy, not {strategy!r}")
    ranker = resolve_ranker(ranker) if strategy == "keep-tail-semantic" else None
    _check_sizes(window_tokens, max_tokens)
    p = _Prompt(prompt, tokenizer, add_generation_prompt)
    available = window_tokens - max_tokens
    part_tokens = tokenizer.count_many(p.parts)
    original = p.count(p.parts)
    overhead = original - sum(part_tokens)
    base = dict(strategy=strategy, window_tokens=window_tokens, max_tokens=max_tokens, overhead_tokens=overhead,
                budget_tokens=available - overhead, original_tokens=original, is_overhead_exact=p.is_exact)
    if original <= available:
        return _result(p, p.parts, original, base)
    if strategy == "error":
        raise ContextLengthExceeded(window_tokens, original, max_tokens, detail=_numbers(base))
    if strategy == "chunk":
        return _fit_chunks(p, part_tokens, available, base)
    if strategy == "keep-tail-semantic":
        return _fit_semantic(p, available, base, ranker)
    return _fit_truncate(p, strategy, part_tokens, available, base)


def _check_sizes(window_tokens: int, max_tokens: int) -> None:
    if not isinstance(window_tokens, int) or window_tokens < 1:
        raise ValueError(f"window_tokens must be a positive integer, got {window_tokens!r}")
    if not isinstance(max_tokens, int) or not 0 <= max_tokens < window_tokens:
        raise ValueError(f"max_tokens must be in [0, window_tokens={window_tokens}), got {max_tokens!r}: "
                         "leave room for the prompt by lowering max_tokens")


def _numbers(base: dict[str, Any]) -> str:
    return (f"Budget for the prompt: {base['budget_tokens']} tokens = window {base['window_tokens']} - "
            f"max_tokens {base['max_tokens']} - template overhead {base['overhead_tokens']}. Use a strategy "
            f"other than 'error' ({', '.join(STRATEGIES[1:])}) to shorten or split it.")


def _result(p: _Prompt, parts: Sequence[str], tokens: int, base: dict[str, Any], **extra) -> FitResult:
    built = p.build(parts)
    text, messages = (built, None) if isinstance(built, str) else (None, built)
    return FitResult(prompt_tokens=tokens, text=text, messages=messages, **base, **extra)


def _refit(p: _Prompt, attempt, start_budget: int, available: int, base: dict[str, Any]) -> tuple[list[str], int]:
    """Run attempt(budget) -> parts, re-count, and lower the budget by the excess until it fits."""
    budget = start_budget
    for _ in range(MAX_REFITS):
        if budget < 0:
            break
        parts = attempt(budget)
        n = p.count(parts)
        if n <= available:
            return parts, n
        budget -= n - available
    raise ContextLengthExceeded(base["window_tokens"], base["original_tokens"], base["max_tokens"],
                                detail=f"The strategy {base['strategy']!r} cannot shorten it enough: the parts it "
                                       f"may not remove already need more. {_numbers(base)}")


def _target(part_tokens: list[int]) -> int:
    """The part a truncation or chunking works on: the longest one (the document)."""
    return max(range(len(part_tokens)), key=lambda i: part_tokens[i])


def _fit_truncate(p: _Prompt, strategy: str, part_tokens: list[int], available: int, base) -> FitResult:
    t = _target(part_tokens)
    truncator = Truncator(p.parts[t], p.tokenizer)
    others = sum(part_tokens) - part_tokens[t]

    def attempt(budget: int) -> list[str]:
        parts = list(p.parts)
        parts[t] = truncator.apply(strategy, budget)
        return parts

    parts, n = _refit(p, attempt, base["budget_tokens"] - others, available, base)
    return _result(p, parts, n, base)


def _fit_semantic(p: _Prompt, available: int, base, ranker: str) -> FitResult:
    protected = {i for i, m in enumerate(p.messages or []) if m.role == "system"}
    units = semantic.build_units(p.parts, protected, p.tokenizer, tail_budget_tokens=base["budget_tokens"] // 2)
    ranking, order = semantic.rank_units(units, p.parts, ranker)  # ranked once; each refit reuses it
    kept: list[bool] = []

    def attempt(budget: int) -> list[str]:
        kept[:] = semantic.select_units(units, order, budget)
        return semantic.rebuild_parts(p.parts, units, kept)

    parts, n = _refit(p, attempt, base["budget_tokens"], available, base)
    return _result(p, parts, n, base, ranker=ranking.ranker, removed=semantic.removed_spans(units, kept))


def _fit_chunks(p: _Prompt, part_tokens: list[int], available: int, base) -> FitResult:
    t = _target(part_tokens)
    budget = base["budget_tokens"] - (sum(part_tokens) - part_tokens[t])
    for _ in range(MAX_REFITS):
        if budget < 1:
            break
        pieces = chunk(p.parts[t], budget, p.tokenizer)
        worst = max(p.count([*p.parts[:t], c.text, *p.parts[t + 1:]]) for c in pieces)
        if worst <= available:
            return FitResult(prompt_tokens=worst, chunks=pieces, chunk_part=t if p.messages else None, **base)
        budget -= worst - available
    raise ContextLengthExceeded(base["window_tokens"], base["original_tokens"], base["max_tokens"],
                                detail="The other messages leave no room for a chunk. " + _numbers(base))
