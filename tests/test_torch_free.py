"""The stages that must never need torch import (every module of them) with torch unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

BLOCK = """
import sys
class _NoTorch:  # any `import torch` raises ImportError; sys.modules keeps no 'torch' entry
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: this stage must not need torch")
sys.meta_path.insert(0, _NoTorch())
"""

PROBE = BLOCK + """
import importlib, pkgutil
package = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""


@pytest.mark.parametrize("package", ["ctxwarden.kv", "ctxwarden.scheduler", "ctxwarden.plan",
                                     "ctxwarden.context", "ctxwarden.spec", "ctxwarden.diagnostics"])
def test_stage_imports_without_torch(package):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 2  # the package and at least one module were imported


def test_engine_config_and_cli_parser_import_without_torch():
    code = (BLOCK + "from ctxwarden.engine.config import EngineConfig\n"
            "from ctxwarden.cli import build_parser\n"
            "build_parser(); EngineConfig(dtype='bfloat16'); print('ok')")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
