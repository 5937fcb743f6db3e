"""keep-tail-semantic: keep the instruction and the question, drop the least relevant sentences.

The prompt is cut into units: sentences (with their trailing whitespace), and pieces of at
most `max_unit_tokens` for sentences longer than that (cut by the chunker, so never inside a
character). Units of the system prompt and of the final paragraph (the instruction or
question) are protected. Every other unit is scored by the question's words it contains,
weighted by inverse unit frequency (a word in every sentence says nothing), with a small
tie-break towards later units. The budget is filled in score order; kept units stay in
their original order, so the result reads as the original text with sentences removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import regex

from ctxwarden.context import segment
from ctxwarden.context.chunk import chunk
from ctxwarden.context.tokenizers import Tokenizer

MAX_UNIT_TOKENS = 128  # longer sentences are split so one sentence is never all-or-nothing
_WORD_RE = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}]|\w+")
_STOPWORDS = frozenset(
    "a an and are as at be but by did do does for from had has have he her his how i in is it its "
    "me my not of on or she that the their them they this to was we were what when where which who "
    "whom why will with you your".split())


@dataclass(frozen=True)
class Unit:
    """A removable (or protected) span of one part of the prompt."""

    part: int  # index of the text part (a message), 0 for plain text
    start: int  # character offset in that part
    end: int
    tokens: int
    is_protected: bool


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence with its trailing whitespace; they tile the text."""
    if not text:
        return []
    levels = segment.boundary_levels(text)
    cps = segment.codepoints(text)
    is_space = np.isin(cps, segment.WHITESPACE_CODEPOINTS)
    # split after the whitespace that follows a sentence end: at p, text[p] is not a space
    split = np.nonzero(levels[1:-1] >= segment.SENTENCE)[0] + 1
    split = split[~is_space[split]]
    bounds = [0, *split.tolist(), len(text)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _paragraph_start(text: str) -> int:
    """Start of the final paragraph (after the last blank line that has text after it)."""
    stripped = text.rstrip()
    k = max(stripped.rfind("\n\n"), stripped.rfind("\n \n"))
    return k + 1 if k >= 0 else 0


def build_units(parts: Sequence[str], protected_parts: set[int], tokenizer: Tokenizer,
                tail_budget_tokens: int) -> list[Unit]:
    """Units of every part; the last part's final paragraph (or last sentence) is protected."""
    spans: list[tuple[int, int, int]] = []
    for p, text in enumerate(parts):
        spans.extend((p, a, b) for a, b in sentence_spans(text))
    counts = tokenizer.count_many([parts[p][a:b] for p, a, b in spans])
    units: list[Unit] = []
    for (p, a, b), n in zip(spans, counts):
        if n > MAX_UNIT_TOKENS and p not in protected_parts:
            pieces = chunk(parts[p][a:b], MAX_UNIT_TOKENS, tokenizer, boundaries="sentence")
            units.extend(Unit(p, a + c.start, a + c.end, c.tokens, False) for c in pieces)
        else:
            units.append(Unit(p, a, b, n, p in protected_parts))
    return _protect_tail(units, parts, tail_budget_tokens)


def _protect_tail(units: list[Unit], parts: Sequence[str], tail_budget_tokens: int) -> list[Unit]:
    if not units:
        return units
    last = len(parts) - 1
    para_start = _paragraph_start(parts[last])
    tail = [i for i, u in enumerate(units) if u.part == last and u.end > para_start]
    if sum(units[i].tokens for i in tail) > tail_budget_tokens:
        tail = tail[-1:]  # the paragraph is a document: protect only its last sentence
    out = list(units)
    for i in tail:
        u = out[i]
        out[i] = Unit(u.part, u.start, u.end, u.tokens, True)
    return out


def _terms(text: str) -> set[str]:
    return {w for w in (m.lower() for m in _WORD_RE.findall(text)) if w not in _STOPWORDS}


def score_units(units: list[Unit], parts: Sequence[str]) -> list[float]:
    """Relevance of each unit to the protected tail (the question); later units break ties."""
    unit_terms = [_terms(parts[u.part][u.start:u.end]) for u in units]
    query: set[str] = set()
    for u, terms in zip(units, unit_terms):
        if u.is_protected and u.part == len(parts) - 1:
            query |= terms
    df: dict[str, int] = {}
    for terms in unit_terms:
        for t in terms & query:
            df[t] = df.get(t, 0) + 1
    n = len(units)
    idf = {t: math.log(1.0 + n / c) for t, c in df.items()}
    return [sum(idf[t] for t in terms & query) + 1e-3 * i / max(n, 1) for i, terms in enumerate(unit_terms)]


def select_units(units: list[Unit], scores: list[float], budget_tokens: int) -> list[bool]:
    """Which units to keep: all protected ones, then the best-scored that still fit."""
    keep = [u.is_protected for u in units]
    left = budget_tokens - sum(u.tokens for u in units if u.is_protected)
    order = sorted((i for i, u in enumerate(units) if not u.is_protected), key=lambda i: -scores[i])
    for i in order:
        if units[i].tokens <= left:
            keep[i] = True
            left -= units[i].tokens
    return keep


def rebuild_parts(parts: Sequence[str], units: list[Unit], keep: list[bool]) -> list[str]:
    """Each part's kept units, in their original order."""
    pieces: list[list[str]] = [[] for _ in parts]
    for u, k in zip(units, keep):
        if k:
            pieces[u.part].append(parts[u.part][u.start:u.end])
    return ["".join(p) for p in pieces]
