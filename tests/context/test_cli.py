"""`ctxwarden count|fit|chunk` end to end, as a user runs them: the first test starts a real
`python -m ctxwarden`; the rest call the same entry point in this process (the `cli` fixture
in tests/conftest.py), which saves a new interpreter per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "ctxwarden", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def sample(emma) -> str:
    return emma[:6000] + "\n\n日本語の文章です。👨‍👩‍👧 🇫🇷"


def test_count_default_tokenizer_matches_library(sample, smol):
    out = _run("count", "-", "--json", stdin=sample)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tokens"] == smol.count_prompt(sample) and data["tokenizer"]["kind"] == "gguf"


def test_chunk_json_offsets(tmp_path, sample, cl100k, cli):
    f = tmp_path / "doc.txt"
    f.write_text(sample, encoding="utf-8")
    rc, stdout, stderr = cli("chunk", f, "--tokenizer", "cl100k_base", "--max-tokens", "100", "--overlap", "10", "--json")
    assert rc == 0, stderr
    chunks = json.loads(stdout)
    assert len(chunks) > 5 and set(chunks[0]) == {"text", "start", "end", "tokens"}
    for c in chunks:
        assert sample[c["start"]:c["end"]] == c["text"] and cl100k.count(c["text"]) == c["tokens"] <= 100


def test_fit_json_and_error_exit(sample, smol, cli):
    rc, stdout, stderr = cli("fit", "-", "--window", "600", "--max-tokens", "100", "--strategy",
                             "keep-tail-semantic", "--json", stdin=sample)
    assert rc == 0, stderr
    data = json.loads(stdout)
    assert data["prompt_tokens"] == smol.count_prompt(data["text"]) <= 500
    rc, _, stderr = cli("fit", "-", "--window", "600", "--max-tokens", "100", stdin=sample)
    assert rc == 2 and "maximum context length is 600 tokens" in stderr


def test_unknown_tokenizer_is_a_clear_error(cli):
    rc, _, stderr = cli("count", "-", "--tokenizer", "gpt-17", stdin="x")
    assert rc == 2 and "Available names:" in stderr and "cl100k_base" in stderr


def test_fit_ranker_flag_says_which_ran(emma, cli):
    doc = emma[200_000:210_000] + "\n\nQuestion: Who was at the party?"
    for ranker, expected in ((None, "hybrid"), ("lexical", "lexical"), ("dense", "dense")):
        args = ["fit", "-", "--window", "800", "--strategy", "keep-tail-semantic", "--json"]
        rc, stdout, stderr = cli(*args, *(["--ranker", ranker] if ranker else []), stdin=doc)
        assert rc == 0, stderr
        data = json.loads(stdout)
        assert data["ranker"] == expected and data["removed"] and "[...]" in data["text"]
    rc, _, stderr = cli("fit", "-", "--window", "800", "--strategy", "keep-tail-semantic", "--ranker", "lexical",
                        stdin=doc)
    assert rc == 0 and "ranker lexical" in stderr and "marked [...]" in stderr
    rc, _, stderr = cli("fit", "-", "--window", "800", "--strategy", "truncate-head", "--ranker", "dense", stdin=doc)
    assert rc == 2 and "only applies to the keep-tail-semantic" in stderr
