"""What the server does with a prompt over the window: the overflow policy of a request.

    body {"ctxwarden": {"on_overflow": POLICY}}   (openai client: extra_body=...)
    else the server's --on-overflow default      (error; fallback when --fallback-model is set)

    error               400 context_length_exceeded (the numbers, and these choices)
    fallback            the next served model with a larger window; 400 when none is configured
    truncate-head       drop the start of the longest part (a chat: the longest message)
    truncate-middle     keep its start and its end
    keep-tail-semantic  keep the system prompt and the final question, drop the sentences least
                        relevant to it (context toolkit, ranker as `fit` picks it)

Fitting is the context toolkit's `fit` with this engine's tokenizer and chat template, so
the template's own tokens are counted; the window is the engine's, minus max_tokens (a chat
without max_tokens keeps FIT_MAX_TOKENS for its answer). Token-id prompts are cut as ids
(no semantic policy for them). The report says, per prompt, how many tokens were dropped and
from where; the response carries it under `ctxwarden` and in x-ctxwarden-* headers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ctxwarden.context import fit

OVERFLOW_POLICIES = ("error", "truncate-head", "truncate-middle", "keep-tail-semantic", "fallback")
FITTING_POLICIES = ("truncate-head", "truncate-middle", "keep-tail-semantic")
FIT_MAX_TOKENS = 16  # the answer room a fitted chat without max_tokens keeps (= completions' default)
_WHERE = {"truncate-head": "head", "truncate-middle": "middle", "keep-tail-semantic": "sentences"}


def check_policy(policy: str, source: str) -> str:
    """The policy, or ValueError naming the value and the choices."""
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"{source} {policy!r} is not an overflow policy; choose one of "
                         f"{', '.join(OVERFLOW_POLICIES)}")
    return policy


@dataclass(frozen=True)
class Cut:
    """What one prompt lost: tokens before and after, where, and (semantic) the spans."""

    prompt_index: int
    original_tokens: int
    prompt_tokens: int
    where: str  # head | middle | sentences
    message_index: int | None = None  # a chat: the message that was cut
    removed: tuple[dict, ...] = ()  # keep-tail-semantic: the removed spans

    @property
    def dropped_tokens(self) -> int:
        return self.original_tokens - self.prompt_tokens


@dataclass(frozen=True)
class OverflowReport:
    """The policy a request ran under and what it did (nothing, unless the prompt overflowed)."""

    policy: str
    cuts: tuple[Cut, ...] = ()
    fell_back_from: str | None = None  # fallback: the model whose window was too small

    @property
    def dropped_tokens(self) -> int:
        return sum(c.dropped_tokens for c in self.cuts)

    def to_dict(self) -> dict[str, Any]:
        """The response's `ctxwarden` field."""
        return {"on_overflow": self.policy, "dropped_tokens": self.dropped_tokens,
                "dropped_from": sorted({c.where for c in self.cuts}), "fell_back_from": self.fell_back_from,
                "cuts": [dict(vars(c), dropped_tokens=c.dropped_tokens, removed=list(c.removed))
                         for c in self.cuts]}

    def headers(self) -> dict[str, str]:
        """x-ctxwarden-overflow (the policy), -dropped-tokens and -dropped-from."""
        out = {"x-ctxwarden-overflow": self.policy, "x-ctxwarden-dropped-tokens": str(self.dropped_tokens)}
        if self.cuts:
            out["x-ctxwarden-dropped-from"] = ",".join(sorted({c.where for c in self.cuts}))
        if self.fell_back_from:
            out["x-ctxwarden-fell-back-from"] = self.fell_back_from
        return out


def fit_job(job, engine, policy: str) -> tuple[Any, OverflowReport]:
    """`job` with every prompt that overflows `engine`'s window fitted by `policy`."""
    tok = engine.tokenizer
    max_tokens = job.max_tokens or FIT_MAX_TOKENS
    window = engine.max_model_len
    prompts, cuts = [], []
    for i, prompt in enumerate(job.prompts):
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
            new, cut = _fit_ids(list(prompt), window - max_tokens, policy, i)
        else:
            if tok is None:
                raise ValueError(f"model {engine.name!r} has no tokenizer: on_overflow {policy!r} needs one")
            new, cut = _fit_text(prompt, window, max_tokens, tok, policy, i)
        prompts.append(new)
        cuts += [cut] if cut is not None else []
    return replace(job, prompts=tuple(prompts)), OverflowReport(policy, tuple(cuts))


def _fit_text(prompt, window: int, max_tokens: int, tok, policy: str, index: int):
    is_chat = not isinstance(prompt, str)
    result = fit(list(prompt) if is_chat else prompt, window, max_tokens, tok, policy)
    if not result.was_changed:
        return prompt, None
    if not is_chat:
        return result.text, Cut(index, result.original_tokens, result.prompt_tokens, _WHERE[policy])
    fitted = tuple({"role": m.role, "content": m.content} for m in result.messages)
    removed = tuple(vars(r) for r in result.removed)
    return fitted, Cut(index, result.original_tokens, result.prompt_tokens, _WHERE[policy],
                       _changed_message(prompt, fitted), removed)


def _changed_message(before, after) -> int | None:
    """The first message whose content the fit changed (a dropped message counts too)."""
    for i, m in enumerate(before):
        if i >= len(after) or after[i]["content"] != m["content"]:
            return i
    return None


def _fit_ids(ids: list[int], budget_tokens: int, policy: str, index: int):
    """Token ids cut as ids: head keeps the last `budget`, middle the first and last halves."""
    if len(ids) <= budget_tokens:
        return ids, None
    if policy == "keep-tail-semantic":
        raise ValueError("on_overflow 'keep-tail-semantic' ranks sentences: send the prompt as text, "
                         "or use truncate-head / truncate-middle for token ids")
    if budget_tokens < 1:
        raise ValueError("max_tokens leaves no room for the prompt in the window; lower max_tokens")
    if policy == "truncate-head":
        kept = ids[-budget_tokens:]
    else:
        head = budget_tokens // 2
        kept = ids[:head] + ids[len(ids) - (budget_tokens - head):]
    return kept, Cut(index, len(ids), len(kept), _WHERE[policy])

