"""The context toolkit is client side: it must import and work with torch unavailable."""

from __future__ import annotations

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
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_context_imports_and_runs_without_torch():
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
