"""Teacher-forced passkey probe: how well a model still reads a key planted deep in a prompt.

    [chat head] filler ... "The pass key is 48213. Remember it. 48213 is the pass key." ... filler
    "What is the pass key?" [chat tail] "The pass key is" + " 48213"   <- scored tokens

The prompt is built at the token level (filler ids cut to length, so the total is exact);
the score is the sum of the key tokens' log p under teacher forcing (prompt logprobs of one
prefill), and `is_top1` says whether every key token was the model's first choice (greedy
decoding would write the key). Free generation is not used: small models confabulate after
"is" even when the key is well within reach (see shared/PERF-NOTES.md). Torch-free: the LLM
is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

QUESTION = "What is the pass key? Answer with the number only."
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
ANSWER_PREFIX = "The pass key is"
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class PasskeyPrompt:
    """Token ids of one probe; the key's tokens are the last `num_key_tokens`."""

    token_ids: tuple[int, ...]
    num_key_tokens: int
    needle_position: int  # the first needle token's index


@dataclass(frozen=True)
class PasskeyScore:
    """Sum of the key tokens' log p, and whether each key token ranked first."""

    logprob: float
    is_top1: bool


def needle_text(key: str) -> str:
    """The sentence that hides `key` in the filler (said twice, as the passkey literature does)."""
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def build_passkey_prompt(tokenizer, num_tokens: int, depth: float, key: str, filler: str = CLASSIC_FILLER
                         ) -> PasskeyPrompt:
    """A probe of exactly `num_tokens` tokens with the needle at `depth` (0..1) of the filler.

    `tokenizer` is the context toolkit's (chat template, encode parsing special tokens);
    `filler` is repeated as needed.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head_text, tail_text = _chat_frame(tokenizer)
    head = tokenizer.encode(head_text + INTRO)
    needle = tokenizer.encode(needle_text(key))
    tail = tokenizer.encode("\n\n" + QUESTION + tail_text + ANSWER_PREFIX)
    key_ids = _key_tokens(tokenizer, key)
    num_filler = num_tokens - len(head) - len(needle) - len(tail) - len(key_ids)
    if num_filler < 1:
        raise ValueError(f"num_tokens {num_tokens} leaves no room for filler (the frame takes "
                         f"{num_tokens - num_filler}); ask for more tokens")
    filler_ids = _filler_ids(tokenizer, filler, num_filler)
    cut = int(round(depth * num_filler))
    ids = head + filler_ids[:cut] + needle + filler_ids[cut:] + tail + key_ids
    return PasskeyPrompt(tuple(ids), len(key_ids), len(head) + cut)


def _chat_frame(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message (generation prompt on)."""
    marker = "\u2063PASSKEY-DOCUMENT\u2063"
    rendered = tokenizer.render_chat([{"role": "user", "content": marker}], add_generation_prompt=True)
    head, tail = rendered.split(marker)
    return head, tail


def _key_tokens(tokenizer, key: str) -> list[int]:
    """The key's tokens as they follow ANSWER_PREFIX (the BPE boundary checked, not assumed)."""
    prefix = tokenizer.encode(ANSWER_PREFIX)
    full = tokenizer.encode(f"{ANSWER_PREFIX} {key}")
    if full[:len(prefix)] != prefix:
        raise ValueError(f"the tokenizer merges {ANSWER_PREFIX!r} with the key; pick another key format")
    return full[len(prefix):]


def _filler_ids(tokenizer, filler: str, num_tokens: int) -> list[int]:
    """A short filler repeated, or a long one's first tokens (only its head is encoded: a
    whole corpus as filler took 4.7 s to encode for a 1,536-token probe)."""
    if len(filler) >= 10_000:
        return _long_filler(tokenizer, filler, num_tokens)
    piece = tokenizer.encode(filler)
    if not piece:
        raise ValueError("filler text encodes to no tokens")
    reps = -(-num_tokens // len(piece))
    return (piece * reps)[:num_tokens]


def _long_filler(tokenizer, text: str, num_tokens: int) -> list[int]:
    """Real prose: the first `num_tokens` tokens of `text` (repeated if it is too short)."""
    ids = tokenizer.encode(text[: num_tokens * 8])
    while len(ids) < num_tokens:
        ids = ids + ids
    return ids[:num_tokens]


def score_prompt_logprobs(prompt: PasskeyPrompt, prompt_logprobs: Sequence) -> PasskeyScore:
    """The score from an engine's prompt logprobs (ScoredToken per prompt token, with top-1)."""
    scored = prompt_logprobs[-prompt.num_key_tokens:]
    logprob = float(sum(s.logprob for s in scored))
    is_top1 = all(s.top_logprobs and s.top_logprobs[0].token_id == s.token_id for s in scored)
    return PasskeyScore(logprob, is_top1)


def score_passkey(llm, prompt: PasskeyPrompt) -> PasskeyScore:
    """Run one prefill of the probe on `llm` (ctxwarden.LLM) and score the key."""
    from ctxwarden.sampling import SamplingParams

    out = llm.generate([list(prompt.token_ids)], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                       show_progress=False)[0]
    return score_prompt_logprobs(prompt, out.prompt_logprobs)
