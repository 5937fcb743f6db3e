"""Split text into chunks of at most `max_tokens` tokens, at the strongest boundary that fits.

Algorithm (one encoding, one re-count per chunk, no recursion):
  1. Encode the whole text once: `Tokenizer.cuts` gives the positions between tokens that are
     also character boundaries, with the token count before each.
  2. Look up the boundary level of each cut (`segment.boundary_levels`: paragraph > sentence >
     line > clause > word > token > inside a grapheme).
  3. From the chunk's start, the furthest cut within max_tokens bounds the chunk. Walk the
     levels from the strongest allowed down; take the last cut of the first level that fills
     at least half the cap (so a paragraph break 10 tokens in does not make a 10-token chunk).
  4. Re-encode every planned piece alone, in one batch (BPE can differ at the edges). If one
     is over the cap, pull its end back by the excess, re-count, and re-plan from there.
  5. The next chunk starts `overlap_tokens` before the end, at a word boundary when one is
     close.
Every chunk is text[start:end] exactly, so offsets are true character offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctxwarden.context import segment
from ctxwarden.context.tokenizers import Tokenizer, TokenCuts
from ctxwarden.errors import ChunkTooSmall

MIN_FILL_FRACTION = 0.5  # a boundary is taken only if the chunk it ends is at least this full
BOUNDARIES = ("paragraph", "sentence", "token")


@dataclass(frozen=True)
class Chunk:
    """One chunk: `text == source[start:end]` and `tokens` is its own re-counted length."""

    text: str
    start: int  # character offset in the source text, inclusive
    end: int  # character offset, exclusive
    tokens: int

    def to_dict(self) -> dict:
        """JSON-ready form: text, start, end, tokens."""
        return {"text": self.text, "start": self.start, "end": self.end, "tokens": self.tokens}


@dataclass(frozen=True)
class ChunkSpec:
    """Validated chunking parameters."""

    max_tokens: int
    overlap_tokens: int = 0
    boundaries: str = "paragraph"

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.overlap_tokens, int) or not 0 <= self.overlap_tokens < self.max_tokens:
            raise ValueError(f"overlap_tokens must be in [0, max_tokens={self.max_tokens}), got "
                             f"{self.overlap_tokens!r}; lower the overlap or raise max_tokens")
        if self.boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries must be one of {', '.join(BOUNDARIES)}, got {self.boundaries!r}")


def chunk(text: str, max_tokens: int, tokenizer: Tokenizer, overlap_tokens: int = 0,
          boundaries: str = "paragraph") -> list[Chunk]:
    """Split `text` into chunks of at most `max_tokens` tokens (re-counted, exact).

    `boundaries` is the strongest boundary preferred: "paragraph" (then sentence, line,
    clause, word, token), "sentence" (sentence down to token) or "token" (fill every chunk).
    `overlap_tokens` tokens of each chunk's end are repeated at the next chunk's start.
    """
    spec = ChunkSpec(max_tokens, overlap_tokens, boundaries)
    if not text:
        return []
    cuts = tokenizer.cuts(text)
    levels = segment.boundary_levels(text)[cuts.cut_chars]
    planner = _Planner(text, cuts, levels, spec, tokenizer)
    return planner.run()


class _Planner:
    """The chunk loop over one text's cuts (state kept here so each step stays small)."""

    def __init__(self, text: str, cuts: TokenCuts, levels: np.ndarray, spec: ChunkSpec, tokenizer: Tokenizer):
        self.text, self.cuts, self.levels, self.spec, self.tokenizer = text, cuts, levels, spec, tokenizer
        self.top_level = segment.LEVEL_NAMES[spec.boundaries]
        self.last = len(cuts.cut_chars) - 1

    def run(self) -> list[Chunk]:
        """Plan every chunk from the one-pass counts, re-count them all in one batch, and
        re-plan from the first chunk the re-count puts over the cap (rare: BPE at a cut)."""
        out: list[Chunk] = []
        i = 0
        while True:
            spans = self._plan_from(i)
            chars = self.cuts.cut_chars
            texts = [self.text[int(chars[a]):int(chars[b])] for a, b in spans]
            counts = self.tokenizer.count_many(texts)
            bad = next((k for k, n in enumerate(counts) if n > self.spec.max_tokens), len(spans))
            out.extend(Chunk(t, int(chars[a]), int(chars[b]), n)
                       for (a, b), t, n in zip(spans[:bad], texts[:bad], counts[:bad]))
            if bad == len(spans):
                return out
            a, b = spans[bad]
            piece = self._fit_recounted(a, b)
            out.extend(piece.chunks)
            if piece.end_index == self.last:
                return out
            i = self._next_start(a, piece.end_index) if len(piece.chunks) == 1 else piece.end_index

    def _plan_from(self, i: int) -> list[tuple[int, int]]:
        """(start cut, end cut) of every chunk from cut i to the end, by one-pass counts."""
        spans = []
        while True:
            end = self._choose_end(i)
            spans.append((i, end))
            if end == self.last:
                return spans
            i = self._next_start(i, end)

    def _limit(self, i: int) -> int:
        """The furthest cut whose one-pass token count from cut i is within the cap (>= i + 1)."""
        tok = self.cuts.cut_tokens
        limit = int(np.searchsorted(tok, tok[i] + self.spec.max_tokens, side="right")) - 1
        return max(limit, i + 1)

    def _choose_end(self, i: int) -> int:
        limit = self._limit(i)
        if limit == self.last:
            return limit
        window = self.levels[i + 1: limit + 1]
        tok = self.cuts.cut_tokens
        min_fill = tok[i] + MIN_FILL_FRACTION * self.spec.max_tokens
        for level in range(self.top_level, segment.TOKEN - 1, -1):
            hits = np.nonzero(window >= level)[0]
            if len(hits) and tok[i + 1 + hits[-1]] >= min_fill:
                return i + 1 + int(hits[-1])
        usable = np.nonzero(window >= segment.TOKEN)[0]
        return i + 1 + int(usable[-1]) if len(usable) else limit  # else only inside-grapheme cuts

    def _fit_recounted(self, i: int, end: int) -> "_Piece":
        """Re-count text[cut i : cut end]; while over the cap, pull the end back by the excess."""
        chars, tok = self.cuts.cut_chars, self.cuts.cut_tokens
        while True:
            start_char, end_char = int(chars[i]), int(chars[end])
            piece = self.text[start_char:end_char]
            n = self.tokenizer.count(piece)
            if n <= self.spec.max_tokens:
                return _Piece([Chunk(piece, start_char, end_char, n)], end)
            if end == i + 1:  # tokens merged across characters leave no cut inside the cap
                return _Piece(self._split_between_cuts(start_char, end_char), end)
            target = tok[end] - (n - self.spec.max_tokens)
            end = max(i + 1, min(end - 1, int(np.searchsorted(tok, target, side="right")) - 1))
            end = self._snap_back(i, end)

    def _snap_back(self, i: int, end: int) -> int:
        """The last cut at or before `end` that is not inside a grapheme, if there is one."""
        usable = np.nonzero(self.levels[i + 1: end + 1] >= segment.TOKEN)[0]
        return i + 1 + int(usable[-1]) if len(usable) else end

    def _split_between_cuts(self, a: int, b: int) -> list[Chunk]:
        """Chunks of text[a:b], a span with no token cut inside (BPE merged bytes of adjacent
        characters), by re-encoding prefixes: binary search for the longest that fits. Only
        reached with caps of a few tokens; spans are a handful of characters."""
        out: list[Chunk] = []
        while a < b:
            lo, hi = a, b  # invariant: text[a:lo] fits (or lo == a); text[a:hi+1..] unknown
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.tokenizer.count(self.text[a:mid]) <= self.spec.max_tokens:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == a:
                self._too_small(a)
            out.append(Chunk(self.text[a:lo], a, lo, self.tokenizer.count(self.text[a:lo])))
            a = lo
        return out

    def _next_start(self, i: int, end: int) -> int:
        """Start of the next chunk: `overlap_tokens` before `end`, on a word boundary if near."""
        if self.spec.overlap_tokens == 0:
            return end
        tok = self.cuts.cut_tokens
        j = max(i + 1, int(np.searchsorted(tok, tok[end] - self.spec.overlap_tokens, side="left")))
        if j >= end:
            return end
        words = np.nonzero(self.levels[j:end] >= segment.WORD)[0]
        return j + int(words[0]) if len(words) else j

    def _too_small(self, pos: int) -> None:
        raise ChunkTooSmall(
            f"max_tokens={self.spec.max_tokens} is too small: the text at character {pos} "
            f"({self.text[pos:pos + 8]!r}) cannot be cut into pieces of that many "
            f"{self.tokenizer.name} tokens without splitting a character. Raise max_tokens "
            "(4 or more always fits a single character in byte-level tokenizers).")


@dataclass(frozen=True)
class _Piece:
    chunks: list[Chunk]
    end_index: int
