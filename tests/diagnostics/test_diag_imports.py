"""The diagnostics package never imports torch, and its functions stay small."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ctxwarden"
TORCH_ALLOWED = {"attention_monitor.py"}  # the live attention monitor (issue 14, phase 2)


def test_diagnostics_modules_import_without_torch():
    modules = sorted(p.stem for p in (SRC / "diagnostics").glob("*.py") if p.name not in TORCH_ALLOWED)
    code = ("import sys\n" + "".join(f"import ctxwarden.diagnostics.{m}\n" for m in modules)
            + "import ctxwarden.cli.diag, ctxwarden.cli.doctor\n"
            + "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(modules) >= 10


def test_no_torch_import_statement_in_diagnostics():
    for path in (SRC / "diagnostics").glob("*.py"):
        if path.name in TORCH_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path.name} imports torch"


def test_functions_stay_under_50_lines_and_have_docstrings():
    paths = [*(SRC / "diagnostics").glob("*.py"), *(SRC / "cli" / "diag").glob("*.py"),
             SRC / "cli" / "doctor.py", SRC / "cli" / "_doctor_probe.py",
             *(SRC / "server" / f"{name}.py" for name in ("owners", "events", "sampler", "crash", "debug", "request_log")),
             SRC / "engine" / "holders.py", SRC / "runner" / "attention_monitor.py"]
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 50, f"{path.name}:{node.name} is {length} lines"
        public = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        public += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                   if isinstance(m, ast.FunctionDef) and not m.name.startswith("__")]
        for node in public:
            if not node.name.startswith("_"):
                assert ast.get_docstring(node), f"{path.name}:{node.name} has no docstring"
