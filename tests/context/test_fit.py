"""fit(): every strategy's result is re-counted and within budget; semantics of each strategy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxwarden.context.fit import STRATEGIES, fit
from ctxwarden.errors import ContextLengthExceeded
from context_textgen import mixed_text

SHORTENING = [s for s in STRATEGIES if s not in ("error", "chunk")]
QUESTION = "\n\nQuestion: what colour was the gate?"


def _check_fits(result, tok, window, max_tokens, messages=False):
    available = window - max_tokens
    if result.chunks:
        assert all(c.tokens <= result.budget_tokens for c in result.chunks)
        assert result.prompt_tokens <= available
        return
    recount = tok.count_chat(result.messages) if messages else tok.count_prompt(result.text)
    assert result.prompt_tokens == recount <= available


@settings(max_examples=40, deadline=None)
@given(text=mixed_text(min_pieces=1, max_pieces=60), window=st.integers(24, 160),
       max_tokens=st.integers(0, 16), strategy=st.sampled_from(STRATEGIES[1:]))
def test_fit_text_never_over_budget(smol, cl100k, text, window, max_tokens, strategy):
    text = text + QUESTION
    for tok in (smol, cl100k):
        try:
            result = fit(text, window, max_tokens, tok, strategy)
        except ContextLengthExceeded:
            # only legitimate when even the protected question cannot fit
            assert strategy == "keep-tail-semantic" and tok.count(QUESTION.strip()) > window - max_tokens - 8
            continue
        _check_fits(result, tok, window, max_tokens)


@settings(max_examples=25, deadline=None)
@given(doc=mixed_text(min_pieces=5, max_pieces=80), window=st.integers(120, 300),
       strategy=st.sampled_from(STRATEGIES[1:]))
def test_fit_messages_never_over_budget(smol, doc, window, strategy):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": doc},
                {"role": "assistant", "content": "Noted. " * 5},
                {"role": "user", "content": "Summarise the document above. What does it say?"}]
    result = fit(messages, window, 16, smol, strategy)
    _check_fits(result, smol, window, 16, messages=True)
    if strategy == "keep-tail-semantic":
        assert result.messages[0].content == "Answer briefly."
        assert result.messages[-1].content == messages[-1]["content"]


def test_error_strategy_states_the_numbers(smol, emma):
    text = emma[:20_000]
    with pytest.raises(ContextLengthExceeded) as e:
        fit(text, 1024, 128, smol, "error")
    msg = str(e.value)
    assert "1024" in msg and "128" in msg and str(smol.count(text)) in msg and "896" in msg


def test_within_budget_is_unchanged(smol):
    r = fit("Short prompt.", 100, 10, smol, "truncate-head")
    assert r.text == "Short prompt." and not r.was_changed


def test_truncations_keep_the_right_end(cl100k, emma):
    text = emma[:30_000]
    head = fit(text, 600, 100, cl100k, "truncate-head")
    tail = fit(text, 600, 100, cl100k, "truncate-tail")
    middle = fit(text, 600, 100, cl100k, "truncate-middle")
    assert text.endswith(head.text) and text.startswith(tail.text)
    half = len(middle.text) // 2
    assert text.startswith(middle.text[:half // 2]) and text.endswith(middle.text[-half // 2:])
    for r in (head, tail, middle):
        assert 490 <= r.prompt_tokens <= 500  # filled to within a few tokens of the budget


def test_semantic_keeps_question_and_relevant_sentence(smol, emma):
    fact = "The garden gate at Donwell was painted a deep cobalt blue that spring."
    doc = emma[:12_000] + "\n\n" + fact + "\n\n" + emma[12_000:24_000]
    question = "\n\nWhat colour was the garden gate at Donwell painted?"
    r = fit(doc + question, 1024, 64, smol, "keep-tail-semantic")
    assert r.text.endswith(question) and fact in r.text
    assert r.prompt_tokens <= 960
    hard = fit(doc + question, 1024, 64, smol, "truncate-head")
    assert fact not in hard.text  # the fact sits far from the end: hard truncation loses it


def test_chunk_strategy_returns_map_reduce_pieces(smol, emma):
    text = emma[:20_000]
    r = fit(text, 1000, 200, smol, "chunk")
    assert len(r.chunks) > 1 and "".join(c.text for c in r.chunks) == text
    assert all(c.tokens <= 800 for c in r.chunks)


def test_template_overhead_is_counted_exactly(smol):
    messages = [{"role": "user", "content": "Hello there."}]
    r = fit(messages, 500, 10, smol, "error")
    assert r.prompt_tokens == smol.count_chat(messages)
    assert r.overhead_tokens == r.prompt_tokens - smol.count("Hello there.") > 10  # default system + markers


def test_bad_arguments(smol):
    with pytest.raises(ValueError, match="unknown strategy"):
        fit("x", 10, 1, smol, "truncate-sideways")
    with pytest.raises(ValueError, match="max_tokens must be in"):
        fit("x", 10, 10, smol)


# keep-tail-semantic with each ranker. Our own no-shared-words pair (not the benchmark's).
PARAPHRASE_FACT = "Mr. Knightley's steward sold forty bushels of wheat at the Kingston market."
PARAPHRASE_QUESTION = "\n\nQuestion: How much grain did the landowner's agent trade in town?"


def _paraphrase_doc(emma: str) -> str:
    return emma[200_000:212_000] + "\n\n" + PARAPHRASE_FACT + "\n\n" + emma[212_000:224_000] + PARAPHRASE_QUESTION


def test_rankers_on_a_paraphrase_with_no_shared_words(smol, emma):
    doc = _paraphrase_doc(emma)
    found = {}
    for ranker in ("lexical", "dense", "hybrid"):
        r = fit(doc, 2048, 256, smol, "keep-tail-semantic", ranker=ranker)
        assert r.ranker == ranker and r.text.endswith(PARAPHRASE_QUESTION)
        assert r.prompt_tokens == smol.count_prompt(r.text) <= 1792
        found[ranker] = PARAPHRASE_FACT in r.text
    assert found == {"lexical": False, "dense": True, "hybrid": True}
    assert fit(doc, 2048, 256, smol, "keep-tail-semantic").ranker == "hybrid"  # the default here


def test_semantic_marks_cuts_and_keeps_document_order(smol, emma):
    doc = _paraphrase_doc(emma)
    r = fit(doc, 1024, 64, smol, "keep-tail-semantic", ranker="hybrid")
    assert r.removed and r.text.count("[...]") == len(r.removed)
    # the kept text is the original with each removed span replaced by a marker, in order
    rebuilt, at = [], 0
    for span in r.removed:
        assert span.part == 0 and at <= span.start < span.end
        rebuilt.append(doc[at:span.start])
        removed = doc[span.start:span.end]
        rebuilt.append(("" if not rebuilt[-1] or rebuilt[-1][-1].isspace() else " ") + "[...]" +
                       (removed[len(removed.rstrip()):] or " "))
        at = span.end
    rebuilt.append(doc[at:])
    assert "".join(rebuilt) == r.text
    assert sum(s.tokens for s in r.removed) >= r.original_tokens - r.prompt_tokens
    assert r.to_dict()["removed"][0] == {"part": 0, "start": r.removed[0].start, "end": r.removed[0].end,
                                         "tokens": r.removed[0].tokens}


def test_semantic_on_messages_drops_emptied_messages_without_markers(smol, emma):
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": emma[300_000:306_000]},
                {"role": "user", "content": emma[306_000:309_000] + "\n\n" + PARAPHRASE_FACT},
                {"role": "user", "content": "How much grain did the landowner's agent trade in town?"}]
    r = fit(messages, 900, 64, smol, "keep-tail-semantic", ranker="hybrid")
    assert r.messages[0].content == "Answer from the documents." and r.messages[-1].content == messages[-1]["content"]
    assert any(PARAPHRASE_FACT in m.content for m in r.messages)
    assert all(m.content.strip() != "[...]" for m in r.messages)
    assert r.prompt_tokens == smol.count_chat(r.messages) <= 900 - 64


def test_ranker_only_for_the_semantic_strategy(smol):
    with pytest.raises(ValueError, match="only applies to the keep-tail-semantic"):
        fit("word " * 200, 64, 8, smol, "truncate-head", ranker="dense")
    with pytest.raises(ValueError, match="unknown ranker"):
        fit("word " * 200, 64, 8, smol, "keep-tail-semantic", ranker="bm25")
    small = fit("Short.", 64, 8, smol, "keep-tail-semantic", ranker="lexical")
    assert small.ranker is None and not small.removed  # it fitted: nothing ranked
