"""The real SmolLM2 tokenizer, shared with the rest of the session (tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(hf_smollm2_tokenizer):
    """The `tokenizers.Tokenizer` behind SmolLM2-135M-Instruct (byte-level BPE, 49,152 ids)."""
    return hf_smollm2_tokenizer.backend_tokenizer
