"""Shared test setup: OpenMP must not spin on these 2 shared cores (set before torch loads)."""

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers on the default model's GGUF (dequantized to fp32, eager attention), loaded
    once per session (about 20 s): (tokenizer, model). The reference of every SmolLM2 parity test."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ctxwarden.spec.checkpoint import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    return tok, model.eval()
