"""Incremental detokenizing on the real SmolLM2 byte-level BPE tokenizer."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxwarden.sampling.detokenize import IncrementalDetokenizer
from ctxwarden.sampling.stop import FinishReason

# Emoji (4-byte, some with ZWJ / skin tones), CJK, accents (composed and combining), ASCII.
MULTILINGUAL = st.lists(
    st.sampled_from(list("ab xyz.,\n\t") + list("éèüñçøß") + ["e\u0301"]
                    + list("中文日本語한국어") + ["😀", "🎉", "👍🏽", "👩‍💻", "🇫🇷", "𝔘"]),
    max_size=30,
).map("".join)
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def _stream(tokenizer, prompt_ids, output_ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas, num_pushed = [], 0
    for token_id in output_ids:
        deltas.append(detok.push(token_id))
        num_pushed += 1
        if detok.is_finished:
            break
    deltas.append(detok.flush())
    return detok, deltas, num_pushed


@FAST
@given(prompt=MULTILINGUAL, text=MULTILINGUAL)
def test_deltas_join_to_the_full_decode_and_never_split_a_character(smollm2_tokenizer,
                                                                    prompt, text):
    output_ids = _encode(smollm2_tokenizer, text)
    detok, deltas, _ = _stream(smollm2_tokenizer, _encode(smollm2_tokenizer, prompt),
                               output_ids)
    full = smollm2_tokenizer.decode(output_ids, skip_special_tokens=True)
    assert "".join(deltas) == full == detok.output_text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.finish_reason is None


def test_emoji_made_of_byte_tokens_waits_until_complete(smollm2_tokenizer):
    ids = _encode(smollm2_tokenizer, "ok 🎉 done")
    pieces = [smollm2_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji really is split across tokens
    detok, deltas, _ = _stream(smollm2_tokenizer, [], ids)
    assert "".join(deltas) == "ok 🎉 done"
    assert "" in deltas[:-1]  # at least one push held its bytes back


def test_decoding_work_per_token_is_bounded(smollm2_tokenizer):
    """O(new text): no decode call ever sees more than a short window of token ids."""

    class CountingTokenizer:
        def __init__(self, inner):
            self.inner, self.max_ids = inner, 0

        def decode(self, ids, skip_special_tokens=True):
            self.max_ids = max(self.max_ids, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    text = ("Emma Woodhouse, handsome, clever, and rich 😀 中文, " * 80)
    ids = _encode(smollm2_tokenizer, text)
    counting = CountingTokenizer(smollm2_tokenizer)
    _, deltas, _ = _stream(counting, ids[:20], ids)
    assert "".join(deltas) == text and len(ids) > 1000
    assert counting.max_ids <= 12


@FAST
@given(text=MULTILINGUAL.filter(lambda t: len(t) >= 2), data=st.data())
def test_stop_string_spanning_tokens_stops_exactly(smollm2_tokenizer, text, data):
    start = data.draw(st.integers(0, len(text) - 2))
    end = data.draw(st.integers(start + 1, min(len(text), start + 8)))
    stop = text[start:end]
    include = data.draw(st.booleans())
    ids = _encode(smollm2_tokenizer, text)
    assert smollm2_tokenizer.decode(ids) == text  # byte-level BPE round-trips
    detok, deltas, num_pushed = _stream(smollm2_tokenizer, [], ids, stop=[stop, "never-seen"],
                                        include_stop_str_in_output=include)
    cut = text.find(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == text[:cut]
    assert detok.finish_reason == FinishReason.STOP == "stop" and detok.stop_string == stop
    # it stopped at the first token whose text completes the stop string, not later
    first_complete = next(j for j in range(1, len(ids) + 1)
                          if stop in smollm2_tokenizer.decode(ids[:j]))
    assert num_pushed == first_complete


def test_text_that_only_starts_a_stop_string_is_released_at_the_end(smollm2_tokenizer):
    ids = _encode(smollm2_tokenizer, "The answer is <|end")
    detok, deltas, _ = _stream(smollm2_tokenizer, [], ids, stop=["<|endoftext|>"])
    assert "".join(deltas[:-1]) == "The answer is "  # "<|end" was held back...
    assert deltas[-1] == "<|end" and detok.finish_reason is None  # ...and flushed at the end


def test_earliest_stop_wins_and_push_after_stop_is_refused(smollm2_tokenizer):
    ids = _encode(smollm2_tokenizer, "alpha beta gamma delta")
    detok, deltas, _ = _stream(smollm2_tokenizer, [], ids, stop=["delta", "beta g"])
    assert "".join(deltas) == "alpha " and detok.stop_string == "beta g"
    with pytest.raises(RuntimeError, match="ended"):
        detok.push(ids[-1])


def test_special_tokens_are_skipped_or_kept(smollm2_tokenizer):
    eos = smollm2_tokenizer.token_to_id("<|im_end|>")
    ids = _encode(smollm2_tokenizer, "Hi there") + [eos]
    _, skipped, _ = _stream(smollm2_tokenizer, [], ids)
    _, kept, _ = _stream(smollm2_tokenizer, [], ids, skip_special_tokens=False)
    assert "".join(skipped) == "Hi there" and "".join(kept) == "Hi there<|im_end|>"


def test_real_corpus_streams_back_exactly(smollm2_tokenizer):
    """A page of Austen and of the Python docs, streamed with a stop string never present."""
    repo = Path(__file__).resolve().parents[2]
    # shared/ sits beside the clone (CI, /work/main) or beside the worktrees' folder
    found = [p / "shared" / "corpora" for p in (repo.parent, repo.parent.parent)
             if (p / "shared" / "corpora").is_dir()]
    if not found:
        pytest.skip(f"no shared/corpora beside {repo}")
    corpora = found[0]
    for path in sorted(corpora.glob("austen/*.txt"))[:1] + [corpora / "python-docs.rst"]:
        text = path.read_text(encoding="utf-8")[5000:9000]
        ids = _encode(smollm2_tokenizer, text)
        _, deltas, _ = _stream(smollm2_tokenizer, ids[:30], ids, stop=["\u2603\u2603"])
        assert "".join(deltas) == smollm2_tokenizer.decode(ids)


def test_invalid_bytes_from_the_model_do_not_stall_the_stream(smollm2_tokenizer):
    """A model can emit byte tokens that never form a character: they stream as U+FFFD."""
    emoji_ids = _encode(smollm2_tokenizer, "🎉")
    assert len(emoji_ids) >= 2
    continuation = emoji_ids[-1]  # a lone UTF-8 continuation byte is invalid forever
    ids = [continuation] * 40 + _encode(smollm2_tokenizer, " fine")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [])
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed.startswith("\ufffd") and streamed.endswith(" fine")
    assert streamed + detok.flush() == smollm2_tokenizer.decode(ids)
