import subprocess
import sys


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "ctxwarden", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "plan" in out.stdout
