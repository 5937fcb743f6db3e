"""The stages that must never need torch import (every module of them) with torch unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

PROBE = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
package = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print(len(names))
"""


@pytest.mark.parametrize("package", ["ctxwarden.kv", "ctxwarden.scheduler", "ctxwarden.plan",
                                     "ctxwarden.context", "ctxwarden.spec"])
def test_stage_imports_without_torch(package):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 2  # the package and at least one module were imported


def test_engine_config_and_cli_parser_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ctxwarden.engine.config import EngineConfig\n"
            "from ctxwarden.cli import build_parser\n"
            "build_parser(); EngineConfig(dtype='bfloat16'); print('ok')")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
