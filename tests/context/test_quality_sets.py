"""The benchmark's no-overlap question set really shares no content word with its facts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "context_quality.py"


@pytest.fixture(scope="module")
def cq():
    spec = importlib.util.spec_from_file_location("context_quality", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_no_overlap_pairs_share_no_content_word(cq):
    assert cq.check_no_overlap_set() == {"austen": 12, "python-docs": 12}
    for corpus, pairs in cq.NO_OVERLAP.items():
        for fact, question in pairs:
            assert "{n}" in fact and "{n}" not in question, (corpus, fact)


def test_the_overlap_check_catches_words_stems_and_substrings(cq):
    assert cq.shared_content_words("The vault code is {n}.", "What is the vault's code?") == ["code~code",
                                                                                              "vault~vault"]
    assert cq.shared_content_words("It unlocks the gate.", "What did it unlock?") == ["unlock~unlocks"]
    assert cq.shared_content_words("Read the email.", "Which mail came?") == ["mail~email"]
    assert cq.shared_content_words("The cat sat.", "Where is the dog?") == []
    cq.NO_OVERLAP["austen"].append(("The gardener planted {n} roses.", "How many roses grew?"))
    try:
        with pytest.raises(AssertionError, match="roses~roses"):
            cq.check_no_overlap_set()
    finally:
        cq.NO_OVERLAP["austen"].pop()
