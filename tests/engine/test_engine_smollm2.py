"""The engine on the real SmolLM2-135M-Instruct, against transformers on the same GGUF."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ctxwarden import SamplingParams
from ctxwarden.spec.checkpoint import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    return hf_smollm2


def test_chat_template_and_greedy_text_match_transformers(smollm, hf):
    tok, model = hf
    ours_ids = smollm.apply_chat_template(QUESTION)
    theirs_ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    theirs_ids = list(theirs_ids["input_ids"] if hasattr(theirs_ids, "keys") else theirs_ids)
    assert ours_ids == theirs_ids
    out = smollm.generate([ours_ids], SamplingParams(max_tokens=32, temperature=0))[0]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([theirs_ids]), max_new_tokens=32, do_sample=False)
    ref_ids = ref[0, len(theirs_ids):].tolist()
    assert list(out.token_ids) == ref_ids[:len(out.token_ids)]
    assert out.text == tok.decode(list(out.token_ids), skip_special_tokens=True)
    assert "Paris" in out.text


def test_stop_string_ends_text_exactly(smollm):
    ids = smollm.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    free = smollm.generate([ids], SamplingParams(max_tokens=60, temperature=0))[0]
    assert "\n5." in free.text
    cut = smollm.generate([ids], SamplingParams(max_tokens=60, temperature=0, stop=["\n5."]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index("\n5.")]


def test_generate_cli_json():
    out = subprocess.run([sys.executable, "-m", "ctxwarden", "generate", "--prompt", "The capital of France is",
                          "--max-tokens", "8", "--json", "--kv-memory", "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["completion_tokens"] == 8 and d["finish_reason"] == "length" and "Paris" in d["text"]
