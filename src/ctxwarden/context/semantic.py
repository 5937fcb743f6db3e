"""keep-tail-semantic: keep the instruction and the question, drop the least relevant sentences.

The prompt is cut into units: sentences (with their trailing whitespace), and pieces of at
most `MAX_UNIT_TOKENS` for sentences longer than that (cut by the chunker, so never inside a
character). Units of the system prompt and of the final paragraph (the instruction or
question) are protected. Every other unit is ranked against the question by
`rank.rank_segments` (lexical BM25, dense embeddings, or both fused). The budget is filled
in rank order; kept units stay in their original order and every run of removed units is
replaced by `REMOVED_MARKER` ("[...]"), so the result reads as the original text with
marked cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ctxwarden.context import segment
from ctxwarden.context.chunk import chunk
from ctxwarden.context.rank import Ranking, rank_segments
from ctxwarden.context.tokenizers import Tokenizer

MAX_UNIT_TOKENS = 128  # longer sentences are split so one sentence is never all-or-nothing
REMOVED_MARKER = "[...]"  # stands where removed sentences were, so the reader sees the cut


@dataclass(frozen=True)
class Unit:
    """A removable (or protected) span of one part of the prompt."""

    part: int  # index of the text part (a message), 0 for plain text
    start: int  # character offset in that part
    end: int
    tokens: int
    is_protected: bool


@dataclass(frozen=True)
class RemovedSpan:
    """A run of removed text: characters [start, end) of part `part` of the original prompt."""

    part: int
    start: int
    end: int
    tokens: int  # the removed units' tokens, each counted alone


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


def question_text(units: list[Unit], parts: Sequence[str]) -> str:
    """The question: the protected units of the last part (its final paragraph or sentence)."""
    last = len(parts) - 1
    return "".join(parts[u.part][u.start:u.end] for u in units if u.is_protected and u.part == last)


def rank_units(units: list[Unit], parts: Sequence[str], ranker: str | None) -> tuple[Ranking, list[int]]:
    """Rank the removable units against the question; returns the ranking and unit indices, best first."""
    free = [i for i, u in enumerate(units) if not u.is_protected]
    ranking = rank_segments(question_text(units, parts), [parts[units[i].part][units[i].start:units[i].end]
                                                          for i in free], ranker)
    return ranking, [free[j] for j in ranking.order()]


def select_units(units: list[Unit], order: list[int], budget_tokens: int) -> list[bool]:
    """Which units to keep: all protected ones, then the removable ones in `order` that still fit."""
    keep = [u.is_protected for u in units]
    left = budget_tokens - sum(u.tokens for u in units if u.is_protected)
    for i in order:
        if units[i].tokens <= left:
            keep[i] = True
            left -= units[i].tokens
    return keep


def removed_spans(units: list[Unit], keep: list[bool]) -> list[RemovedSpan]:
    """Maximal runs of removed units within one part, as character spans of the original part."""
    spans: list[RemovedSpan] = []
    for u, k in zip(units, keep):
        if k:
            continue
        prev = spans[-1] if spans else None
        if prev is not None and prev.part == u.part and prev.end == u.start:
            spans[-1] = RemovedSpan(u.part, prev.start, u.end, prev.tokens + u.tokens)
        else:
            spans.append(RemovedSpan(u.part, u.start, u.end, u.tokens))
    return spans


def rebuild_parts(parts: Sequence[str], units: list[Unit], keep: list[bool],
                  marker: str = REMOVED_MARKER) -> list[str]:
    """Each part's kept units in their original order, with `marker` where a run was removed.

    The marker takes the removed run's trailing whitespace (so paragraph breaks survive) and
    is set off by a space from kept text it would otherwise touch. A part with nothing kept
    becomes empty (fit then drops that message), not a lone marker.
    """
    pieces: list[list[str]] = [[] for _ in parts]
    gaps = {(s.part, s.start): s for s in removed_spans(units, keep)}
    for u, k in zip(units, keep):
        out = pieces[u.part]
        if k:
            out.append(parts[u.part][u.start:u.end])
        elif marker and (u.part, u.start) in gaps:
            removed = parts[u.part][u.start:gaps[u.part, u.start].end]
            lead = " " if out and not out[-1][-1:].isspace() else ""
            tail = removed[len(removed.rstrip()):] or " "
            out.append(lead + marker + tail)
    has_kept = {u.part for u, k in zip(units, keep) if k}
    return ["".join(p) if j in has_kept else "" for j, p in enumerate(pieces)]
