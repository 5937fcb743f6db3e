"""Real servers for the tests: uvicorn in a background thread on a free loopback port.

Checkpoints are tiny random llamas with a trained BPE tokenizer (fast); one test module
serves the real SmolLM2. Every network call goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from ctxwarden.models.random_checkpoint import MakeModelOptions, make_checkpoint
from ctxwarden.server.app import ServerConfig, create_app

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
START_TIMEOUT_S = 60.0


def _checkpoint(tmp_path_factory, name: str, max_position: int):
    out = tmp_path_factory.mktemp(name)
    return make_checkpoint(MakeModelOptions(arch="llama", out_dir=out, hidden_size=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, vocab_size=512,
                                            max_position=max_position, with_tokenizer=True))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny llama, window 1024."""
    return _checkpoint(tmp_path_factory, "tiny-llama", 1024)


@pytest.fixture(scope="session")
def small_window_dir(tmp_path_factory):
    """A tiny llama with a 128-token window (fallback primary; bounded fuzzing)."""
    return _checkpoint(tmp_path_factory, "tiny-small", 128)


@pytest.fixture(scope="session")
def api_keys():
    """API key -> tenant, as in the key file."""
    return dict(KEYS)


@pytest.fixture(scope="session")
def long_window_dir(tmp_path_factory):
    """A tiny llama with an 8192-token window (fallback target; long-running requests)."""
    return _checkpoint(tmp_path_factory, "tiny-long", 8192)


@pytest.fixture(scope="session")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# test tenants\n" + "".join(f"{k} {t}  # {t}'s key\n" for k, t in KEYS.items()) + "\n")
    return path


@pytest.fixture(scope="session", name="free_port")
def free_port_fixture():
    """`free_port()`: a loopback port nobody listens on."""
    return free_port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A running server: its base URL and the app (for engine-side checks)."""

    url: str
    app: object

    @property
    def engines(self):
        return self.app.state.server.engines

    def engine_call(self, fn, engine_index: int = 0):
        """Run fn(engine) on the engine thread and return its result."""
        return asyncio.run(self.engines[engine_index].call(fn))

    def metric(self, name: str, **labels) -> float:
        """The sum of one metric's samples whose labels include `labels`."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, value = line.rsplit(" ", 1)
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total, found = total + float(value), True
        if not found and not labels:
            raise AssertionError(f"metric {name} is missing from /metrics")
        return total

    def wait_metric(self, name: str, value: float, timeout_s: float = 10.0) -> float:
        """Poll until the metric equals `value` (or the timeout); returns the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.metric(name)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture(scope="session")
def serve():
    """`serve(config)`: a context manager running a server for one test."""
    return _serve


@contextmanager
def _serve(config: ServerConfig):
    """Run create_app(config) under uvicorn in a thread until the block ends."""
    import uvicorn

    app = create_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        server.should_exit = True
        raise RuntimeError(f"server on {url} did not become ready in {START_TIMEOUT_S} s")
    try:
        yield LiveServer(url, app)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def tiny_server(tiny_dir, key_file):
    """The tiny model behind two tenants' keys."""
    with _serve(ServerConfig.build(model=str(tiny_dir), kv_memory="8MiB", api_keys=str(key_file),
                            max_body_bytes=256 * 1024)) as s:
        yield s


@pytest.fixture()
def openai_client(tiny_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="key-alpha", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tiny_model_id(tiny_server):
    return tiny_server.engines[0].name
