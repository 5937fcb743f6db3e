"""Fixtures for the context toolkit tests: real tokenizers, real corpora, mixed-script text."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxwarden.context.tokenizers import load_tokenizer

# CI keeps a copy of shared/ beside the clone; locally it is /work/shared.
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
if not SHARED.is_dir():
    SHARED = Path("/work/shared")
CORPORA = SHARED / "corpora"

@pytest.fixture(scope="session")
def smol():
    """The default model's tokenizer (SmolLM2, built from its GGUF)."""
    return load_tokenizer()


@pytest.fixture(scope="session")
def cl100k():
    """tiktoken cl100k_base, loaded offline."""
    return load_tokenizer("cl100k_base")


@pytest.fixture(scope="session")
def emma() -> str:
    """Jane Austen's Emma (883 KB of real prose)."""
    return (CORPORA / "austen" / "emma.txt").read_text()


@pytest.fixture(scope="session")
def python_docs() -> str:
    """Python documentation sources (headings, lists, code)."""
    return (CORPORA / "python-docs.rst").read_text()
