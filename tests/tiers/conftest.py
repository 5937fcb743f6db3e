"""Real components for the tier tests: a redis-server on a free loopback port, tiny checkpoints.

The Redis server is Debian's (or any `redis-server` on PATH; `make install` installs it).
Fault tests send it real signals: SIGKILL (dead), SIGSTOP / SIGCONT (hung, then back).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """One redis-server process on 127.0.0.1:port, no persistence, LRU under maxmemory."""

    port: int = field(default_factory=free_port)
    maxmemory: str = "256mb"
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; `make install` installs Debian's redis-server")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not listen on {self.port} within {START_TIMEOUT_S} s")

    def client(self):
        import redis
        return redis.Redis(port=self.port, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL: the server is gone (connections reset)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped process dies only once resumed
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT: the hung server answers again."""
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill, then start an empty server on the same port."""
        self.kill()
        self.start()


@pytest.fixture
def redis_server():
    """A fresh redis-server for one test, SIGKILLed at the end."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()


def tiny_checkpoint(out, seed: int = 0, max_position: int = 1024):
    return make_checkpoint(MakeModelOptions(arch="llama", out_dir=out, hidden_size=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, vocab_size=512,
                                            max_position=max_position, with_tokenizer=True, seed=seed))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny llama (window 1024) with a trained tokenizer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiers-tiny"))
