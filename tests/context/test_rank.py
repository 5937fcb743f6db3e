"""rank_segments: BM25, dense (real all-MiniLM-L6-v2), hybrid; the encoder registry and its LRU cache."""

from __future__ import annotations

import numpy as np
import pytest

from ctxwarden.context.encoders import CachedEncoder, is_encoder_available, load_encoder
from ctxwarden.context.rank import (HYBRID_DENSE_WEIGHT, RANKERS, Ranking, bm25_scores, default_ranker,
                                    hybrid_scores, rank_segments, resolve_ranker)
from ctxwarden.embed.minilm import MiniLMEncoder

# Our own no-shared-words pair (not the benchmark's): question and evidence share no content word.
QUESTION = "Which beverage did the physician forbid the elderly gentleman?"
EVIDENCE = "Mr. Perry told old Mr. Woodhouse that he must give up his evening glass of port wine."


@pytest.fixture(scope="module")
def sentences(emma) -> list[str]:
    """80 real sentences of Emma with the evidence among them."""
    from ctxwarden.context.semantic import sentence_spans

    text = emma[120_000:140_000]
    spans = sentence_spans(text)[:80]
    out = [text[a:b] for a, b in spans]
    out.insert(37, EVIDENCE + " ")
    return out


def test_bm25_prefers_rare_shared_words():
    segs = ["The gate was painted.", "The archive gate on the east side was painted blue.", "Nothing here at all."]
    scores = bm25_scores("what colour is the east archive gate", segs)
    assert scores[1] > scores[0] > 0 and scores[2] == 0


def test_lexical_ties_go_to_the_later_segment():
    r = rank_segments("lamp", ["a lamp", "no", "a lamp"], "lexical")
    assert r.ranker == "lexical" and r.order() == [2, 0, 1] and r.encoder is None


def test_lexical_misses_a_paraphrase_dense_and_hybrid_find_it(sentences):
    at = sentences.index(EVIDENCE + " ")
    lexical = rank_segments(QUESTION, sentences, "lexical")
    assert lexical.scores[at] == 0  # no shared word: BM25 cannot see it
    for name in ("dense", "hybrid"):
        r = rank_segments(QUESTION, sentences, name)
        assert r.ranker == name and r.encoder == "all-MiniLM-L6-v2"
        assert r.order().index(at) < 5, (name, r.order().index(at))  # top 5 of 81


def test_hybrid_keeps_lexical_wins(sentences):
    """A question that names the evidence's rare words: hybrid ranks it first, as BM25 does."""
    at = sentences.index(EVIDENCE + " ")
    q = "What did Perry say about port wine?"
    assert rank_segments(q, sentences, "lexical").order()[0] == at
    assert rank_segments(q, sentences, "hybrid").order()[0] == at


def test_hybrid_scores_are_a_normalised_weighted_sum():
    lexical, dense = np.array([0.0, 2.0, 4.0]), np.array([0.5, -0.5, 0.0])
    got = hybrid_scores(lexical, dense)
    w = HYBRID_DENSE_WEIGHT
    assert np.allclose(got, [w * 1.0 + 0, w * 0.0 + (1 - w) * 0.5, w * 0.5 + (1 - w) * 1.0])
    assert np.allclose(hybrid_scores(np.zeros(3), np.full(3, 0.2)), 0)  # no spread, no information


def test_relevance_is_scaled_to_the_best():
    r = Ranking("dense", (0.5, -0.2, 0.25))
    assert r.relevance() == [1.0, 0.0, 0.5]
    assert Ranking("lexical", (0.0, 0.0)).relevance() == [0.0, 0.0]


def test_ranker_names_and_default():
    assert is_encoder_available() and default_ranker() == "hybrid"
    assert resolve_ranker(None) == resolve_ranker("auto") == "hybrid"
    assert all(resolve_ranker(n) == n for n in RANKERS)
    with pytest.raises(ValueError, match="lexical, dense, hybrid"):
        resolve_ranker("semantic")
    assert rank_segments("q", [], "hybrid").scores == ()


def test_loaded_encoder_is_shared_and_cached():
    enc = load_encoder()
    assert enc is load_encoder() and isinstance(enc, CachedEncoder) and enc.dim == 384
    with pytest.raises(ValueError, match="known encoders: all-MiniLM-L6-v2"):
        load_encoder("bge-large")


def test_lru_cache_counts_and_evicts_least_recently_used():
    inner = MiniLMEncoder(dtype="float32")
    enc = CachedEncoder(inner, max_entries=2)
    first = enc.encode(["alpha", "beta", "alpha"])  # alpha is encoded once
    assert (enc.stats().hits, enc.stats().misses, enc.stats().entries) == (0, 3, 2)
    enc.encode(["alpha"])  # hit: alpha is now the most recent
    enc.encode(["gamma"])  # evicts beta, the least recently used
    enc.encode(["alpha"])
    assert (enc.stats().hits, enc.stats().misses) == (2, 4)
    again = enc.encode(["beta"])  # was evicted: a miss, encoded again, same vector
    assert enc.stats().misses == 5 and np.allclose(again[0], first[1], atol=1e-6)
    assert np.array_equal(first[0], first[2]) and np.allclose(first[0], inner.encode(["alpha"])[0], atol=1e-6)
    with pytest.raises(ValueError, match="max_entries"):
        CachedEncoder(inner, max_entries=-1)
