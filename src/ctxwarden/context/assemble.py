"""Assemble context from fragments under a token budget: TTL, decaying weights, routing.

Each fragment has a source ("memory", "docs", "web", ...), a weight, a creation time, an
optional time-to-live and a `required` flag. `assemble`:
  1. drops fragments whose source the query's intent may not use (`IntentRoutes`),
  2. drops expired fragments (age > ttl_ms),
  3. decays each weight by age: weight * 0.5 ** (age_ms / half_life_ms); with a `query`, the
     priority is that decayed weight times the fragment's relevance to the query (in [0, 1]:
     `rank.rank_segments` score over the best one; lexical, dense or hybrid ranker),
  4. places every required fragment (raising RequiredContextExceeded if they cannot fit),
  5. fills the rest of the budget by priority, highest first, skipping what does not fit,
  6. re-counts the joined text and, if the separators made it overshoot, drops the lowest
     weighted optional fragment until it fits.
Kept fragments keep their input order. Every dropped fragment is reported with its reason.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping, Sequence

from ctxwarden.context.rank import rank_segments
from ctxwarden.context.tokenizers import Tokenizer
from ctxwarden.errors import FragmentError, RequiredContextExceeded

DEFAULT_HALF_LIFE_MS = 3_600_000  # an hour-old fragment counts half


@dataclass(frozen=True)
class Fragment:
    """One piece of candidate context."""

    fragment_id: str
    text: str
    source: str
    weight: float = 1.0
    created_at_ms: int | None = None  # epoch milliseconds; None = now
    ttl_ms: int | None = None  # None = never expires
    required: bool = False

    def __post_init__(self) -> None:
        fid = self.fragment_id if isinstance(self.fragment_id, str) and self.fragment_id else "<no id>"
        if fid == "<no id>":
            raise FragmentError(fid, "fragment_id", f"must be a non-empty string, got {self.fragment_id!r}")
        if not isinstance(self.text, str):
            raise FragmentError(fid, "text", f"must be a string, got {type(self.text).__name__}")
        if not isinstance(self.source, str) or not self.source:
            raise FragmentError(fid, "source", f"must be a non-empty string, got {self.source!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight >= 0):
            raise FragmentError(fid, "weight", f"must be a finite number >= 0, got {self.weight!r}")
        for name in ("created_at_ms", "ttl_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise FragmentError(fid, name, f"must be a non-negative integer (milliseconds) or null, got {value!r}")
        if not isinstance(self.required, bool):
            raise FragmentError(fid, "required", f"must be true or false, got {self.required!r}")


def fragment_from_dict(data: Mapping[str, Any], index: int = 0) -> Fragment:
    """A Fragment from JSON-like data; unknown or missing fields are errors naming the fragment."""
    fid = str(data.get("fragment_id", data.get("id", f"#{index}")))
    known = {f.name for f in fields(Fragment)}
    values = dict(data)
    if "id" in values and "fragment_id" not in values:
        values["fragment_id"] = values.pop("id")
    unknown = sorted(set(values) - known)
    if unknown:
        raise FragmentError(fid, unknown[0], f"is not a fragment field; known fields: {', '.join(sorted(known))}")
    for name in ("fragment_id", "text", "source"):
        if name not in values:
            raise FragmentError(fid, name, "is required but missing")
    return Fragment(**values)


@dataclass(frozen=True)
class IntentRoutes:
    """Which sources each intent may draw on, e.g. {"billing": {"crm", "invoices"}}."""

    routes: Mapping[str, frozenset[str]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", {k: frozenset(v) for k, v in self.routes.items()})

    def allows(self, intent: str, source: str) -> bool:
        """True if `intent` may use `source`; an unknown intent is an error listing the known ones."""
        if intent not in self.routes:
            raise ValueError(f"unknown intent {intent!r}; routed intents: {', '.join(sorted(self.routes))}")
        return source in self.routes[intent]


@dataclass(frozen=True)
class KeptFragment:
    """A fragment that made it in, with its token count and decayed weight."""

    fragment_id: str
    source: str
    tokens: int
    effective_weight: float
    relevance: float | None = None  # to the query, in [0, 1]; None without a query


@dataclass(frozen=True)
class DroppedFragment:
    """A fragment left out, and why: "not-routed", "expired" or "over-budget"."""

    fragment_id: str
    source: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Assembly:
    """The assembled context and its accounting."""

    text: str
    tokens: int  # re-counted, separators included; always <= budget_tokens
    budget_tokens: int
    kept: list[KeptFragment] = field(default_factory=list)
    dropped: list[DroppedFragment] = field(default_factory=list)
    ranker: str | None = None  # the ranker that scored relevance to the query; None without a query

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"text": self.text, "tokens": self.tokens, "budget_tokens": self.budget_tokens, "ranker": self.ranker,
                "kept": [vars(k) for k in self.kept], "dropped": [vars(d) for d in self.dropped]}


@dataclass(frozen=True)
class _Candidate:
    index: int
    fragment: Fragment
    tokens: int
    effective_weight: float
    relevance: float | None = None

    @property
    def priority(self) -> float:
        """Decayed weight, times relevance to the query when there is one."""
        return self.effective_weight if self.relevance is None else self.effective_weight * self.relevance


def assemble(fragments: Sequence[Fragment | Mapping[str, Any]], budget_tokens: int, tokenizer: Tokenizer,
             intent: str | None = None, routes: IntentRoutes | None = None, now_ms: int | None = None,
             half_life_ms: int = DEFAULT_HALF_LIFE_MS, separator: str = "\n\n", *, query: str | None = None,
             ranker: str | None = None) -> Assembly:
    """Choose fragments for a budget (see the module docstring for the order of decisions).

    With `query`, fragments are ranked against it by `ranker` (lexical, dense, hybrid; None =
    hybrid when the embedding model is installed, else lexical).
    """
    if not isinstance(budget_tokens, int) or budget_tokens < 0:
        raise ValueError(f"budget_tokens must be a non-negative integer, got {budget_tokens!r}")
    if half_life_ms <= 0:
        raise ValueError(f"half_life_ms must be positive, got {half_life_ms!r}")
    frags = [f if isinstance(f, Fragment) else fragment_from_dict(f, i) for i, f in enumerate(fragments)]
    _check_unique_ids(frags)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    dropped: list[DroppedFragment] = []
    live = _filter_live(frags, intent, routes, now, dropped)
    counts = tokenizer.count_many([f.text for _, f in live])
    cands = [_Candidate(i, f, n, _decayed(f, now, half_life_ms)) for (i, f), n in zip(live, counts)]
    cands, ranker_ran = _with_relevance(cands, query, ranker)
    chosen = _fill(cands, budget_tokens, tokenizer.count(separator), dropped)
    return replace(_finish(chosen, budget_tokens, tokenizer, separator, dropped), ranker=ranker_ran)


def _with_relevance(cands: list[_Candidate], query: str | None,
                    ranker: str | None) -> tuple[list[_Candidate], str | None]:
    """Each candidate's relevance to the query (none without a query), and the ranker that ran."""
    if query is None:
        if ranker is not None:
            raise ValueError(f"a ranker ({ranker!r}) needs a query to rank fragments against; pass query=...")
        return cands, None
    ranking = rank_segments(query, [c.fragment.text for c in cands], ranker)
    return [replace(c, relevance=r) for c, r in zip(cands, ranking.relevance())], ranking.ranker


def _check_unique_ids(frags: Iterable[Fragment]) -> None:
    seen: set[str] = set()
    for f in frags:
        if f.fragment_id in seen:
            raise FragmentError(f.fragment_id, "fragment_id", "is used by more than one fragment")
        seen.add(f.fragment_id)


def _filter_live(frags: list[Fragment], intent: str | None, routes: IntentRoutes | None, now: int,
                 dropped: list[DroppedFragment]) -> list[tuple[int, Fragment]]:
    live = []
    for i, f in enumerate(frags):
        age = _age_ms(f, now)
        if intent is not None and routes is not None and not routes.allows(intent, f.source):
            dropped.append(DroppedFragment(f.fragment_id, f.source, "not-routed",
                                           f"intent {intent!r} may not use source {f.source!r}"))
        elif f.ttl_ms is not None and age > f.ttl_ms:
            dropped.append(DroppedFragment(f.fragment_id, f.source, "expired",
                                           f"age {age} ms > ttl_ms {f.ttl_ms}"))
        else:
            live.append((i, f))
    return live


def _age_ms(f: Fragment, now: int) -> int:
    if f.created_at_ms is None:
        return 0
    if f.created_at_ms > now:
        raise FragmentError(f.fragment_id, "created_at_ms",
                            f"{f.created_at_ms} is in the future (now is {now}); pass epoch milliseconds")
    return now - f.created_at_ms


def _decayed(f: Fragment, now: int, half_life_ms: int) -> float:
    return f.weight * 0.5 ** (_age_ms(f, now) / half_life_ms)


def _fill(cands: list[_Candidate], budget: int, sep_tokens: int, dropped: list[DroppedFragment]) -> list[_Candidate]:
    """Required fragments first, then the rest by priority (then weight, then newest first on ties)."""
    required = [c for c in cands if c.fragment.required]
    need = sum(c.tokens for c in required) + sep_tokens * max(len(required) - 1, 0)
    if need > budget:
        raise RequiredContextExceeded(budget, need, [c.fragment.fragment_id for c in required])
    chosen, used = list(required), need
    optional = sorted((c for c in cands if not c.fragment.required),
                      key=lambda c: (-c.priority, -c.effective_weight, -(c.fragment.created_at_ms or 0), c.index))
    for c in optional:
        cost = c.tokens + (sep_tokens if chosen else 0)
        if used + cost <= budget:
            chosen.append(c)
            used += cost
        else:
            dropped.append(DroppedFragment(c.fragment.fragment_id, c.fragment.source, "over-budget",
                                           f"needs {cost} tokens, {budget - used} of {budget} left"))
    return chosen


def _finish(chosen: list[_Candidate], budget: int, tokenizer: Tokenizer, separator: str,
            dropped: list[DroppedFragment]) -> Assembly:
    """Join in input order and re-count; drop the weakest optional fragment while over budget."""
    chosen = sorted(chosen, key=lambda c: c.index)
    while True:
        text = separator.join(c.fragment.text for c in chosen)
        tokens = tokenizer.count(text)
        if tokens <= budget:
            kept = [KeptFragment(c.fragment.fragment_id, c.fragment.source, c.tokens, c.effective_weight, c.relevance)
                    for c in chosen]
            return Assembly(text, tokens, budget, kept, dropped)
        optional = [c for c in chosen if not c.fragment.required]
        if not optional:
            raise RequiredContextExceeded(budget, tokens, [c.fragment.fragment_id for c in chosen])
        weakest = min(optional, key=lambda c: (c.priority, c.effective_weight, -c.index))
        chosen.remove(weakest)
        dropped.append(DroppedFragment(weakest.fragment.fragment_id, weakest.fragment.source, "over-budget",
                                       f"joined text re-counted at {tokens} > budget {budget}"))
