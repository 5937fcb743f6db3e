"""Crash bundles: on the first 5xx answer or engine failure, write what an incident needs.

    <crash_dir>/crash-<UTC time>-<request id or "engine">.json:
    {"time", "reason", "request": {ids, tenant, model, status, token counts, each choice's
     finish reason and error; "prompts" only with --debug-dump-prompts} | null,
     "events": the ring's last `window_s` seconds, "samples": the memory samples of that
     window, "memory": the /debug/memory snapshot, "engines": each engine's failure}

Only the first incident of the process is written (later ones are counted in the log): the
first is the one that explains the rest. The file is written on its own thread (to a temporary
name, then renamed), so the request path never waits on the disk.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("ctxwarden.server")
DEFAULT_WINDOW_S = 600.0


class CrashRecorder:
    """Writes the first crash bundle of the process into `crash_dir`."""

    def __init__(self, crash_dir: str, state, sampler, cgroup_root: str, window_s: float = DEFAULT_WINDOW_S,
                 dump_prompts: bool = False):
        self.crash_dir, self.state, self.sampler = Path(crash_dir), state, sampler
        self.cgroup_root, self.window_s, self.dump_prompts = cgroup_root, window_s, dump_prompts
        self._lock = threading.Lock()
        self._is_written = False
        self.num_skipped = 0
        self.crash_dir.mkdir(parents=True, exist_ok=True)

    def on_5xx(self, call) -> None:
        """A request answered 5xx (`call`: server.calls.Call)."""
        self._trigger(f"HTTP {call.status} for request {call.tags.request_id}", _request_of(call, self.dump_prompts))

    def on_engine_failure(self, reason: str) -> None:
        """The server cannot serve any more (a dead engine or a failed load)."""
        self._trigger(reason, None)

    def _trigger(self, reason: str, request: dict | None) -> None:
        with self._lock:
            if self._is_written:
                self.num_skipped += 1
                log.warning("another incident (%s); the crash bundle of the first is already written", reason)
                return
            self._is_written = True
        if self.sampler is not None:
            self.sampler.sample_now()  # the memory at the incident itself
        now = time.time()
        events = self.state.events.events(since=now - self.window_s)
        threading.Thread(target=self._write, args=(now, reason, request, events), name="crash-bundle",
                         daemon=True).start()

    def _write(self, now: float, reason: str, request: dict | None, events: list[dict]) -> None:
        from ctxwarden.server.debug import server_snapshot

        try:
            bundle = {"time": now, "reason": reason, "request": request, "events": events,
                      "samples": self.sampler.samples(since=now - self.window_s) if self.sampler else [],
                      "memory": server_snapshot(self.state.engines, self.cgroup_root),
                      "engines": {e.name: {"failure": e.failure} for e in self.state.engines}}
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
            name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in
                           (request["request_id"] if request else "engine"))[:80]
            path = self.crash_dir / f"crash-{stamp}-{name}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(bundle, indent=1, default=str) + "\n", encoding="utf-8")
            os.replace(tmp, path)
            log.error("crash bundle written to %s (%s)", path, reason)
        except Exception:  # noqa: BLE001 - the incident is already being answered
            log.exception("writing the crash bundle failed")


def _request_of(call, dump_prompts: bool) -> dict:
    gen, tags = call.gen, call.tags
    out = {"request_id": tags.request_id, "tenant": tags.tenant, "trace_id": tags.trace_id, "api_id": call.api_id,
           "model": gen.engine.name, "status": call.status, "created": call.created,
           "prompt_tokens": gen.num_prompt_tokens, "completion_tokens": gen.num_completion_tokens,
           "cached_tokens": gen.num_cached_tokens,
           "choices": [{"engine_request_id": c.request_id, "finish_reason": c.finish_reason, "error": c.error,
                        "num_prompt_tokens": c.num_prompt_tokens, "num_output_tokens": len(c.token_ids)}
                       for c in gen.choices]}
    if dump_prompts:
        out["prompts"] = list(call.job.prompts)  # --debug-dump-prompts only: may hold user data
    return out
