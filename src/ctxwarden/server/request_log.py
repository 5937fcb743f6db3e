"""The server's request log: one JSONL line per finished API request, never any text.

The line is `diagnostics.request_log.RequestRecord` (time at arrival, request id, tenant,
prompt / completion / cached tokens, TTFT, time per output token, status), so `ctxwarden
diag lengths` and `diag slo-risk` read the file as it is. `serve --request-log FILE`
appends to FILE; each line is written and flushed whole under a lock.
"""

from __future__ import annotations

import threading
import time

from ctxwarden.diagnostics.request_log import RequestRecord


class RequestLogWriter:
    """Appends RequestRecords to a JSONL file (thread-safe)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: RequestRecord) -> None:
        """One line, flushed."""
        line = record.to_json() + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            self._file.close()


def record_of(gen, request_id: str, tenant: str, status: int) -> RequestRecord:
    """The log record of one settled API request (`gen`: server.generation.Generation)."""
    firsts = [c.first_token_s for c in gen.choices if c.first_token_s is not None]
    ttft = min(firsts) - gen.arrival_s if firsts else None
    tpots = [(c.finished_s - c.first_token_s) / (len(c.token_ids) - 1) for c in gen.choices
             if c.first_token_s is not None and c.finished_s is not None and len(c.token_ids) > 1]
    outcome = "ok" if status == 200 else "abort" if status == 499 else "error"
    arrival_unix = time.time() - (time.monotonic() - gen.arrival_s)
    return RequestRecord(arrival_unix, request_id, tenant, gen.num_prompt_tokens, gen.num_completion_tokens,
                         gen.num_cached_tokens, ttft, sum(tpots) / len(tpots) if tpots else None, outcome)
