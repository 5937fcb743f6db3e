"""assemble(): TTL, decay, routing, required fragments, budget, validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxwarden.context.assemble import Fragment, IntentRoutes, assemble, fragment_from_dict
from ctxwarden.errors import FragmentError, RequiredContextExceeded

NOW = 1_800_000_000_000
HOUR = 3_600_000


def _frag(fid, text, source="docs", **kw):
    return Fragment(fid, text, source, **kw)


def test_expired_fragments_drop_with_reason(cl100k):
    frags = [_frag("old", "stale news", ttl_ms=HOUR, created_at_ms=NOW - 2 * HOUR),
             _frag("new", "fresh news", ttl_ms=HOUR, created_at_ms=NOW - HOUR // 2)]
    a = assemble(frags, 100, cl100k, now_ms=NOW)
    assert [k.fragment_id for k in a.kept] == ["new"]
    assert [(d.fragment_id, d.reason) for d in a.dropped] == [("old", "expired")]


def test_weights_decay_with_age(cl100k):
    # equal size; the old one has twice the weight but is two half-lives old (0.5 effective)
    frags = [_frag("old-heavy", "alpha " * 30, weight=2.0, created_at_ms=NOW - 2 * HOUR),
             _frag("new-light", "beta " * 30, weight=1.0, created_at_ms=NOW)]
    a = assemble(frags, cl100k.count("alpha " * 30) + 2, cl100k, now_ms=NOW, half_life_ms=HOUR)
    assert [k.fragment_id for k in a.kept] == ["new-light"]
    assert a.kept[0].effective_weight == 1.0
    assert a.dropped[0].fragment_id == "old-heavy" and a.dropped[0].reason == "over-budget"


def test_budget_fills_by_weight_and_keeps_input_order(cl100k):
    frags = [_frag(f"f{i}", f"fragment number {i} " * 5, weight=float(w)) for i, w in enumerate([1, 5, 3, 4, 2])]
    per = cl100k.count(frags[0].text) + cl100k.count("\n\n")
    a = assemble(frags, 3 * per, cl100k, now_ms=NOW)
    assert [k.fragment_id for k in a.kept] == ["f1", "f2", "f3"]  # weights 5, 3, 4, in input order
    assert a.tokens == cl100k.count(a.text) <= 3 * per
    assert {d.fragment_id for d in a.dropped} == {"f0", "f4"}


def test_required_that_cannot_fit_raises(cl100k):
    frags = [_frag("policy", "must include " * 50, required=True), _frag("extra", "nice to have")]
    with pytest.raises(RequiredContextExceeded, match="policy") as e:
        assemble(frags, 20, cl100k, now_ms=NOW)
    assert e.value.budget_tokens == 20 and e.value.required_tokens == cl100k.count("must include " * 50)


def test_required_always_kept_before_heavier_optional(cl100k):
    frags = [_frag("heavy", "x " * 40, weight=100.0), _frag("req", "needed text", required=True, weight=0.0)]
    a = assemble(frags, cl100k.count("needed text") + 5, cl100k, now_ms=NOW)
    assert [k.fragment_id for k in a.kept] == ["req"]


def test_intent_routing(cl100k):
    routes = IntentRoutes({"billing": {"invoices", "crm"}, "support": {"docs"}})
    frags = [_frag("i1", "invoice 42", "invoices"), _frag("d1", "how to reset", "docs"), _frag("c1", "crm note", "crm")]
    a = assemble(frags, 100, cl100k, intent="billing", routes=routes, now_ms=NOW)
    assert [k.fragment_id for k in a.kept] == ["i1", "c1"]
    assert [(d.fragment_id, d.reason) for d in a.dropped] == [("d1", "not-routed")]
    with pytest.raises(ValueError, match="routed intents: billing, support"):
        assemble(frags, 100, cl100k, intent="sales", routes=routes, now_ms=NOW)


def test_validation_names_fragment_and_field():
    with pytest.raises(FragmentError, match="fragment 'f7': field 'weight'"):
        Fragment("f7", "text", "docs", weight=-1.0)
    with pytest.raises(FragmentError, match="fragment 'f8': field 'ttl_ms'"):
        Fragment("f8", "text", "docs", ttl_ms=-5)
    with pytest.raises(FragmentError, match="fragment 'f9': field 'colour'"):
        fragment_from_dict({"fragment_id": "f9", "text": "t", "source": "s", "colour": "red"})
    with pytest.raises(FragmentError, match="fragment 'f10': field 'source': is required"):
        fragment_from_dict({"fragment_id": "f10", "text": "t"})
    with pytest.raises(FragmentError, match="fragment '#2': field 'fragment_id'"):
        fragment_from_dict({"text": "t", "source": "s"}, index=2)
    with pytest.raises(FragmentError, match="field 'created_at_ms'"):
        assemble([Fragment("f", "t", "s", created_at_ms=NOW + 1)], 10, None, now_ms=NOW)


@settings(max_examples=40, deadline=None)
@given(data=st.lists(st.tuples(st.text(max_size=60), st.floats(0, 10), st.integers(0, 5 * HOUR),
                               st.booleans()), max_size=12),
       budget=st.integers(0, 120))
def test_assembly_within_budget_and_accounts_for_every_fragment(cl100k, data, budget):
    frags = [Fragment(f"f{i}", t, "docs", weight=w, created_at_ms=NOW - age, ttl_ms=3 * HOUR)
             for i, (t, w, age, _) in enumerate(data)]
    a = assemble(frags, budget, cl100k, now_ms=NOW)
    assert a.tokens == cl100k.count(a.text) <= budget
    ids = [k.fragment_id for k in a.kept] + [d.fragment_id for d in a.dropped]
    assert sorted(ids) == sorted(f.fragment_id for f in frags)
    assert all(d.reason in ("expired", "over-budget") for d in a.dropped)


MEMORY = [("m1", "The user's cat is called Biscuit and sleeps on the radiator."),
          ("m2", "The user prefers invoices as PDF attachments sent on the first of the month."),
          ("m3", "The user is allergic to peanuts and carries an epinephrine pen."),
          ("m4", "The user's flat is on the fourth floor; the lift is often broken.")]


@pytest.mark.parametrize("ranker,expected", [("dense", "m3"), ("hybrid", "m3")])
def test_query_ranks_fragments_by_meaning(cl100k, ranker, expected):
    """No fragment shares a word with the query; the embedding model still finds the right one."""
    frags = [_frag(fid, text, "memory") for fid, text in MEMORY]
    budget = max(cl100k.count(t) for _, t in MEMORY) + 2  # room for one fragment
    a = assemble(frags, budget, cl100k, now_ms=NOW, query="Which foods might trigger a dangerous reaction?",
                 ranker=ranker)
    assert a.ranker == ranker and [k.fragment_id for k in a.kept] == [expected]
    assert a.kept[0].relevance == 1.0 and a.to_dict()["ranker"] == ranker
    assert {d.fragment_id for d in a.dropped} == {"m1", "m2", "m4"}


def test_query_relevance_multiplies_decayed_weight(cl100k):
    """Equal relevance (same text): the heavier fragment wins; no relevance at all: weight decides."""
    frags = [_frag("light", "peanut allergy noted", "memory", weight=1.0),
             _frag("heavy", "peanut allergy noted", "memory", weight=3.0)]
    a = assemble(frags, cl100k.count("peanut allergy noted") + 1, cl100k, now_ms=NOW, query="peanut allergy",
                 ranker="lexical")
    assert [k.fragment_id for k in a.kept] == ["heavy"] and a.kept[0].relevance == 1.0
    plain = assemble(frags, 100, cl100k, now_ms=NOW)
    assert plain.ranker is None and all(k.relevance is None for k in plain.kept)
    with pytest.raises(ValueError, match="needs a query"):
        assemble(frags, 100, cl100k, now_ms=NOW, ranker="dense")
