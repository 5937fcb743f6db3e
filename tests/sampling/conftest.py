"""The real SmolLM2 tokenizer, loaded once per session (about 8 s from the GGUF)."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The `tokenizers.Tokenizer` behind SmolLM2-135M-Instruct (byte-level BPE, 49,152 ids)."""
    transformers = pytest.importorskip("transformers")
    from ctxwarden.spec.checkpoint import default_model_path

    path = default_model_path()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                              gguf_file=path.name)
    return hf_tokenizer.backend_tokenizer
