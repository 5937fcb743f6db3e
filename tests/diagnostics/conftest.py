"""A real child process that allocates on command, so memory readers see real pages."""

import subprocess
import sys
from pathlib import Path

import pytest

from diag_paths import FIXTURES  # noqa: F401  (re-exported for fixtures)

# The child keeps what it is told to keep; every buffer is written so its pages are resident.
CHILD = r"""
import ctypes, sys
kept, scratch = [], []
for line in sys.stdin:
    cmd, *arg = line.split()
    n = int(arg[0]) if arg else 0
    if cmd == "keep":            # a leak: n bytes kept forever
        kept.append(bytearray(b"\x01") * n)
    elif cmd == "churn":         # a request's transient memory: allocated, touched, dropped
        b = bytearray(b"\x02") * n
        del b
    elif cmd == "small":         # n bytes in 2 KiB malloc'ed pieces, kept until "drop"
        scratch.extend(bytearray(b"\x03") * 2048 for _ in range(n // 2048))
    elif cmd == "drop":          # free the small pieces but one at the top: the heap cannot shrink
        del scratch[:-1]
    elif cmd == "trim":          # glibc malloc_trim(0): return free heap pages to the kernel
        print("trimmed", ctypes.CDLL("libc.so.6").malloc_trim(0), flush=True)
        continue
    print("ok", flush=True)
"""


class Child:
    """A python child driven line by line; `send` waits for its answer."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def send(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def child():
    c = Child()
    yield c
    c.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama checkpoint with a tokenizer (built once per session)."""
    from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

    out = tmp_path_factory.mktemp("diag-tiny-llama")
    make_checkpoint(MakeModelOptions(arch="llama", out_dir=out, hidden_size=64, num_layers=2, num_heads=4,
                                     num_kv_heads=2, vocab_size=512, max_position=1024, with_tokenizer=True))
    return out
