"""Any ASGI app under uvicorn on a free loopback port, in a thread that can be stopped and
started again on the same port (a replica restart)."""

from __future__ import annotations

import socket
import threading
import time

import httpx

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`make_app()` served on 127.0.0.1:port until `stop()`; `start()` again for a restart."""

    def __init__(self, make_app, port: int | None = None, ready_path: str = "/health"):
        self.make_app, self.port, self.ready_path = make_app, port or free_port(), ready_path
        self.app = self._server = self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        import uvicorn

        self.app = self.make_app()
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.url} did not become ready in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(30)
            self._server = None

    def metric(self, name: str, **labels) -> float:
        """The sum of one metric's samples on /metrics whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith((name + "{", name + " ")):
                head, value = line.rsplit(" ", 1)
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total
