"""Boundary strength of every character position: paragraph > sentence > line > clause > word > token.

`boundary_levels(text)` returns an int8 array of len(text) + 1 entries; entry p says how good a
place position p (between text[p-1] and text[p]) is to cut. The chunker and `fit` look these
up at the token cuts of one encoding, so the hierarchy costs a few vectorised passes over the
code points instead of one re-encoding per candidate split.

Level INSIDE_GRAPHEME marks positions inside a user-perceived character (an emoji ZWJ
sequence, a flag, a skin-tone modifier, a base letter and its combining marks, CR LF): a cut
there is legal (it is between code points) but only used when nothing else fits.
"""

from __future__ import annotations

import re

import numpy as np
import regex

INSIDE_GRAPHEME = 0
TOKEN = 1
WORD = 2
CLAUSE = 3
LINE = 4
SENTENCE = 5
PARAGRAPH = 6
LEVEL_NAMES = {"paragraph": PARAGRAPH, "sentence": SENTENCE, "token": TOKEN}

WHITESPACE_CODEPOINTS = np.array([9, 10, 11, 12, 13, 32, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                        0x2028, 0x2029, 0x202F, 0x205F, 0x3000], dtype=np.uint32)
_CJK_RANGES = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
               (0xFF66, 0xFF9F), (0x20000, 0x2FA1F))
_CLAUSE_PUNCT = np.array([ord(c) for c in ",;:，、；：)"], dtype=np.uint32)
_PARAGRAPH_RE = re.compile(r"\n[^\S\n]*\n\s*")
# Sentence ends: Latin punctuation before whitespace (with closing quotes/brackets), or CJK
# full stops anywhere. A single "." after a common abbreviation ("Mr.") or an initial ("J.")
# does not end a sentence; the lookbehinds sit after the "." so they run only at dots.
_SENTENCE_RE = regex.compile(
    r"\.(?<!\b(?i:mr|mrs|ms|dr|st|jr|sr|vs|etc|e\.g|i\.e|cf|no|fig|col|gen|capt|rev|prof)\.)(?<!\b\p{Lu}\.)"
    r"[\"'”’)\]]*(?=\s|$)"
    r"|(?:[!?…]+|\.{2,})[\"'”’)\]]*(?=\s|$)|[。！？]+[」』”’）]*")
# Characters that extend a grapheme cluster (or pair into one): only words holding one of
# these need the (slower) grapheme segmentation.
_EXTENDERS_RE = regex.compile(r"[\p{M}\u200d\ufe00-\ufe0f\U0001F1E6-\U0001F1FF\U0001F3FB-\U0001F3FF"
                              r"\U000E0020-\U000E007F\U000E0100-\U000E01EF]")


def codepoints(text: str) -> np.ndarray:
    """The text's code points as uint32 [len(text)]."""
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def boundary_levels(text: str) -> np.ndarray:
    """int8 [len(text) + 1]: the boundary level of each position (see the module docstring)."""
    n = len(text)
    levels = np.full(n + 1, TOKEN, dtype=np.int8)
    if n == 0:
        return levels
    cp = codepoints(text)
    ws = np.isin(cp, WHITESPACE_CODEPOINTS)
    _mark_words(levels, cp, ws)
    _mark_clauses(levels, cp, ws)
    _mark_lines(levels, cp)
    _mark_sentences(levels, text, ws)
    for m in _PARAGRAPH_RE.finditer(text):
        levels[m.start()] = levels[m.end()] = PARAGRAPH
    _mark_inside_graphemes(levels, text, cp, ws)
    levels[0] = levels[n] = PARAGRAPH  # the ends of the text are the strongest boundaries
    return levels


def _mark_words(levels: np.ndarray, cp: np.ndarray, ws: np.ndarray) -> None:
    cjk = np.zeros(len(cp), dtype=bool)
    for lo, hi in _CJK_RANGES:
        cjk |= (cp >= lo) & (cp <= hi)
    # p in 1..n-1 sits between cp[p-1] and cp[p]; CJK has no spaces, so any CJK neighbour counts
    inner = (ws[:-1] | ws[1:]) | (cjk[:-1] | cjk[1:])
    levels[1:-1][inner] = WORD


def _run_ends(ws: np.ndarray) -> np.ndarray:
    """Positions where a whitespace run ends (ws[p-1] and not ws[p], or the end of the text)."""
    n = len(ws)
    ends = np.nonzero(ws[:-1] & ~ws[1:])[0] + 1
    return np.concatenate((ends, [n])) if n and ws[-1] else ends


def _mark_after(levels: np.ndarray, positions: np.ndarray, ws: np.ndarray, level: int) -> None:
    """Mark each position, and the end of the whitespace run that follows it, at `level`."""
    if len(positions) == 0:
        return
    levels[positions] = np.maximum(levels[positions], level)
    ends = _run_ends(ws)
    if len(ends) == 0:
        return
    k = np.searchsorted(ends, positions, side="left")
    ok = k < len(ends)
    run_end = ends[k[ok]]
    starts_run = ws[np.minimum(positions[ok], len(ws) - 1)] & (positions[ok] < len(ws))
    targets = run_end[starts_run]
    levels[targets] = np.maximum(levels[targets], level)


def _mark_clauses(levels: np.ndarray, cp: np.ndarray, ws: np.ndarray) -> None:
    after = np.nonzero(np.isin(cp, _CLAUSE_PUNCT))[0] + 1
    _mark_after(levels, after, ws, CLAUSE)


def _mark_lines(levels: np.ndarray, cp: np.ndarray) -> None:
    newline = np.nonzero(cp == 10)[0]
    levels[newline + 1] = np.maximum(levels[newline + 1], LINE)
    levels[newline] = np.maximum(levels[newline], LINE)


def _mark_sentences(levels: np.ndarray, text: str, ws: np.ndarray) -> None:
    ends = np.fromiter((m.end() for m in _SENTENCE_RE.finditer(text)), dtype=np.int64)
    _mark_after(levels, ends, ws, SENTENCE)


_GRAPHEME_RE = regex.compile(r"\X")
_IDEOGRAPHS = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF))


def _is_ideograph(cp: np.ndarray) -> np.ndarray:
    out = np.zeros(len(cp), dtype=bool)
    for lo, hi in _IDEOGRAPHS:
        out |= (cp >= lo) & (cp <= hi)
    return out


def _safe_cluster_starts(cp: np.ndarray) -> np.ndarray:
    """Positions before which a grapheme cluster always begins: code points below U+0300
    (never extenders, joiners, spacing marks or regional indicators) other than LF (after CR)
    and the pictographs (C) and (R) (which a ZWJ can join), and CJK ideographs. A preceding
    Prepend character (rare: Arabic number signs) would join them; that case is ignored."""
    safe = (cp < 0x300) & (cp != 0x0A) & (cp != 0xA9) & (cp != 0xAE)
    return np.nonzero(safe | _is_ideograph(cp))[0]


def _extender_candidates(cp: np.ndarray) -> np.ndarray:
    """Positions that may hold a grapheme extender: every extender is >= U+0300, and CJK
    ideographs and Hangul syllables (most of an East Asian text) never are."""
    cand = (cp >= 0x300) & ~_is_ideograph(cp) & ~((cp >= 0xAC00) & (cp <= 0xD7A3))
    return np.nonzero(cand)[0]


def _mark_inside_graphemes(levels: np.ndarray, text: str, cp: np.ndarray, ws: np.ndarray) -> None:
    crlf = np.nonzero((cp[:-1] == 13) & (cp[1:] == 10))[0] + 1
    levels[crlf] = INSIDE_GRAPHEME
    hits = np.fromiter((p for p in _extender_candidates(cp).tolist() if _EXTENDERS_RE.match(text, p)), dtype=np.int64)
    if len(hits) == 0:
        return
    # Segment only the stretch around each hit, from the safe cluster start at or before it
    # to the next one: those stretches are a few characters, so \X stays cheap.
    starts = np.concatenate((_safe_cluster_starts(cp), [len(cp)]))
    k = np.searchsorted(starts, hits, side="right")
    lo = np.where(k > 0, starts[np.maximum(k - 1, 0)], 0)
    hi = starts[np.minimum(k, len(starts) - 1)]
    for a, b in sorted(set(zip(lo.tolist(), hi.tolist()))):
        for m in _GRAPHEME_RE.finditer(text, a, b):
            if m.end() - m.start() > 1:
                levels[m.start() + 1: m.end()] = INSIDE_GRAPHEME
