"""`ctxwarden make-model`: the checkpoint and tokenizer load in transformers as they are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_cli_writes_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "qwen3"
    proc = subprocess.run([sys.executable, "-m", "ctxwarden", "make-model", "--arch", "qwen3",
                           "--out", str(out), "--hidden-size", "32", "--layers", "1", "--heads", "2",
                           "--kv-heads", "1", "--head-dim", "16", "--vocab-size", "300",
                           "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout)["files"]
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.head_dim == 16 and model.config.num_hidden_layers == 1
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("It is a truth universally acknowledged")["input_ids"]
    assert max(ids) < 300 and len(ids) < len("It is a truth universally acknowledged")
    assert tok.decode(ids) == "It is a truth universally acknowledged"


@pytest.mark.parametrize("argv,message", [
    (["--arch", "llama", "--sliding-window", "8"], "llama has no sliding window"),
    (["--arch", "llama", "--heads", "3", "--kv-heads", "2"], "--kv-heads 2 must divide --heads 3"),
    (["--arch", "llama", "--rope-scaling", "{bad"], "rope_scaling is not valid JSON"),
    (["--arch", "llama", "--vocab-size", "100"], "too small for a byte-level tokenizer"),
])
def test_cli_refuses_bad_options(tmp_path, argv, message, cli):
    rc, _, stderr = cli("make-model", "--out", tmp_path / "x", *argv)
    assert rc == 2 and message in stderr and not (tmp_path / "x").exists()


def test_tokenizer_is_trained_on_the_shipped_text_wherever_it_runs(tmp_path):
    """The default training text is the package's own: the same tokenizer as training on a
    directory holding exactly that text, from any working directory."""
    import gzip
    from importlib import resources

    from ctxwarden.models.random_checkpoint import write_tokenizer

    shipped = resources.files("ctxwarden.models").joinpath("data/tokenizer_text.txt.gz").read_bytes()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text(gzip.decompress(shipped).decode("utf-8"))
    for name, corpus_dir in (("default", None), ("explicit", corpus)):
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name, 400, 128, corpus_dir)
    # an explicit corpus is capped at 400K characters; the shipped text is below that
    assert len(gzip.decompress(shipped)) < 400_000
    assert (tmp_path / "default" / "tokenizer.json").read_text() == \
        (tmp_path / "explicit" / "tokenizer.json").read_text()
