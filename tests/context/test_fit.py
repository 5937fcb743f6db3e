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
