"""chunk(): exact token caps, true offsets, lossless tiling, safe on scripts and emoji."""

from __future__ import annotations

import re

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxwarden.context.chunk import ChunkTooSmall, chunk
from context_textgen import mixed_text


def _check_chunks(text, chunks, tok, max_tokens, overlap_tokens):
    """The invariants every chunking must satisfy."""
    if not text:
        assert chunks == []
        return
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for c in chunks:
        assert text[c.start:c.end] == c.text and c.text
        assert c.tokens == tok.count(c.text) <= max_tokens
    for a, b in zip(chunks, chunks[1:]):
        assert a.start < b.start <= a.end
        if overlap_tokens == 0:
            assert b.start == a.end  # tiling: joining the chunks gives the text back
    if overlap_tokens == 0:
        assert "".join(c.text for c in chunks) == text


@settings(max_examples=60, deadline=None)
@given(text=mixed_text(), max_tokens=st.integers(4, 48), overlap_frac=st.floats(0, 0.9),
       boundaries=st.sampled_from(["paragraph", "sentence", "token"]))
def test_chunks_respect_cap_on_mixed_script(smol, cl100k, text, max_tokens, overlap_frac, boundaries):
    overlap = int(overlap_frac * (max_tokens - 1))
    for tok in (smol, cl100k):
        chunks = chunk(text, max_tokens, tok, overlap_tokens=overlap, boundaries=boundaries)
        _check_chunks(text, chunks, tok, max_tokens, overlap)


@settings(max_examples=30, deadline=None)
@given(text=mixed_text(min_pieces=5), max_tokens=st.integers(24, 64))
def test_chunks_do_not_split_graphemes_that_fit(cl100k, text, max_tokens):
    """When every grapheme (emoji ZWJ sequence, flag, skin tone, letter + marks) fits the cap,
    no chunk boundary falls inside one."""
    clusters = [m.group() for m in regex.finditer(r"\X", text)]
    if any(cl100k.count(g) > max_tokens // 3 for g in clusters):
        return  # a cluster too big to keep whole may be cut as a last resort
    inside = set()
    pos = 0
    for g in clusters:
        inside.update(range(pos + 1, pos + len(g)))
        pos += len(g)
    for c in chunk(text, max_tokens, cl100k):
        assert c.start not in inside and c.end not in inside


def test_emma_chunks_end_on_sentences_or_paragraphs(cl100k, emma):
    chunks = chunk(emma, 512, cl100k)
    _check_chunks(emma, chunks, cl100k, 512, 0)
    ends_sentence = sum(bool(re.search(r"([.!?][\"')\]]*\s*|\n\s*\n\s*)$", c.text)) for c in chunks)
    assert ends_sentence >= 0.95 * len(chunks)
    assert sum(c.tokens for c in chunks) / len(chunks) > 0.75 * 512  # and are well filled


def test_overlap_repeats_the_end_of_the_previous_chunk(smol, emma):
    text = emma[:40_000]
    chunks = chunk(text, 200, smol, overlap_tokens=40)
    _check_chunks(text, chunks, smol, 200, 40)
    for a, b in zip(chunks, chunks[1:]):
        shared = text[b.start:a.end]
        assert 0 < smol.count(shared) <= 40 + 1  # +1: BPE may differ by a token at the cut


@pytest.mark.parametrize("text", ["a" * 6000, "😀" * 3000, "中" * 5000, "🇫🇷" * 800, "👨‍👩‍👧‍👦" * 300,
                                  "x" * 3000 + " " * 3000 + "\n" * 500])
def test_long_unbroken_strings(smol, cl100k, text):
    for tok in (smol, cl100k):
        _check_chunks(text, chunk(text, 64, tok), tok, 64, 0)


def test_cap_too_small_for_one_character(cl100k):
    rare = "\U00040000"  # an unassigned code point: four byte tokens in cl100k
    assert cl100k.count(rare) == 4
    with pytest.raises(ChunkTooSmall, match="max_tokens=2"):
        chunk("ab " + rare, 2, cl100k)
    assert [c.text for c in chunk("ab " + rare, 4, cl100k)][-1].endswith(rare)


def test_invalid_parameters_name_the_limit(cl100k):
    with pytest.raises(ValueError, match="overlap_tokens must be in"):
        chunk("text", 10, cl100k, overlap_tokens=10)
    with pytest.raises(ValueError, match="boundaries must be one of"):
        chunk("text", 10, cl100k, boundaries="chapter")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        chunk("text", 0, cl100k)


def test_estimate_tokenizer_chunks_by_characters():
    from ctxwarden.context.tokenizers import load_tokenizer

    est = load_tokenizer("estimate")
    text = "One sentence here. Another one there.\n\nA new paragraph 😀 with emoji." * 20
    _check_chunks(text, chunk(text, 25, est), est, 25, 0)
