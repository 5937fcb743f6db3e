"""The passkey probe's prompt: exact length, the needle at the asked depth, the key scored last."""

from __future__ import annotations

import pytest

from ctxwarden import LLM
from ctxwarden.context.tokenizers import load_tokenizer
from ctxwarden.diagnostics.passkey import (ANSWER_PREFIX, INTRO, QUESTION, _chat_frame, build_passkey_prompt,
                                           needle_text, score_passkey)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_prompt_has_the_exact_length_and_the_needle_at_depth(tok, depth):
    p = build_passkey_prompt(tok, 900, depth, "48213")
    ids = list(p.token_ids)
    assert len(ids) == 900
    needle = tok.encode(needle_text("48213"))
    assert ids[p.needle_position:p.needle_position + len(needle)] == needle
    assert tok.decode(ids[-p.num_key_tokens:]).strip() == "48213"
    assert tok.decode(ids[-p.num_key_tokens - 30:-p.num_key_tokens]).endswith(ANSWER_PREFIX)
    head_text, tail_text = _chat_frame(tok)
    head = tok.encode(head_text + INTRO)
    tail = tok.encode("\n\n" + QUESTION + tail_text + ANSWER_PREFIX)
    num_filler = 900 - len(head) - len(needle) - len(tail) - p.num_key_tokens
    assert p.needle_position - len(head) == round(depth * num_filler)  # the needle splits the filler where asked


def test_bad_sizes_are_refused_with_the_numbers(tok):
    with pytest.raises(ValueError, match="depth must be in"):
        build_passkey_prompt(tok, 900, 1.5, "1")
    with pytest.raises(ValueError, match="num_tokens 20 leaves no room"):
        build_passkey_prompt(tok, 20, 0.5, "48213")


def test_score_is_the_key_tokens_log_p(tiny_model_dir, tok):
    llm = LLM(str(tiny_model_dir), kv_memory="4MiB")
    p = build_passkey_prompt(tok, 300, 0.5, "48213")
    score = score_passkey(llm, p)
    from ctxwarden.sampling import SamplingParams

    out = llm.generate([list(p.token_ids)], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert score.logprob == pytest.approx(sum(lp.logprob for lp in out.prompt_logprobs[-p.num_key_tokens:]))
    assert score.logprob < 0


def test_a_long_filler_gives_its_first_tokens_and_only_its_head_is_encoded(tok):
    prose = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 30_000
    lengths = []

    class Recording:  # the real tokenizer, noting how much text each encode gets
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, *args, **kwargs):
            lengths.append(len(text))
            return tok.encode(text, *args, **kwargs)

    p = build_passkey_prompt(Recording(), 600, 0.0, "48213", filler=prose)
    head_text, _ = _chat_frame(tok)
    start = len(tok.encode(head_text + INTRO)) + len(tok.encode(needle_text("48213")))
    filler = list(p.token_ids[start:len(p.token_ids) - p.num_key_tokens])
    first = tok.encode(prose[:20_000])
    assert filler[:400] == first[:400]  # the text's own first tokens, in order
    assert max(lengths) < len(prose) // 100  # a 2.7 MB filler is not encoded whole
