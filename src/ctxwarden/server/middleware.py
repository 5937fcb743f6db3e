"""Per-request context on the ASGI side: request ids in headers and logs, body-size limit.

    x-request-id: the client's (bounded, printable ASCII) or a fresh one, on every response
                  and in every log line of the request (`RequestIdLogFilter`)
    traceparent:  a valid W3C trace context header's trace id goes to `trace_id_var` (logs,
                  events, KV owners); a malformed one is ignored, as the spec says
    body:         read up front; past `max_body_bytes` the request is answered 413, chunked
                  bodies included; the app then reads the buffered body and, after it, the
                  live channel (so a disconnect is still seen)
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from fastapi.responses import Response

from ctxwarden.server.errors import APIError

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
trace_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)
MAX_REQUEST_ID_CHARS = 128
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


class RequestContextMiddleware:
    """x-request-id on every response (and in every log line); 413 for oversized bodies."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = _clean_request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        token = request_id_var.set(rid)
        trace_token = trace_id_var.set(parse_traceparent(headers.get(b"traceparent", b"").decode("latin-1")))
        send = _with_request_id(send, rid)
        try:
            length = headers.get(b"content-length", b"").decode("latin-1")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return await self._too_large(f"is {int(length)} bytes")(scope, receive, send)
            messages = await self._read_body(receive)
            if messages is None:
                return await self._too_large("exceeds that")(scope, receive, send)
            await self.app(scope, _replay(messages, receive), send)
        finally:
            request_id_var.reset(token)
            trace_id_var.reset(trace_token)

    def _too_large(self, what: str) -> Response:
        return APIError(413, f"The request body {what}; this server accepts at most {self.max_body_bytes} "
                        "bytes (--max-body-bytes).", param="body", code="request_too_large").response()

    async def _read_body(self, receive) -> list[dict] | None:
        """The body's messages, read up front (None past the limit: chunked bodies have no length)."""
        messages, num_bytes = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[dict], receive):
    """A receive() that returns the buffered body first, then the live channel (disconnects)."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()
    return replay


def _with_request_id(send, rid: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            message = {**message, "headers": headers + [(b"x-request-id", rid.encode("latin-1"))]}
        await send(message)
    return wrapped


def _clean_request_id(given: str) -> str:
    """The client's x-request-id if it is short and printable; a fresh one otherwise."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable() and given.isascii():
        return given
    return uuid.uuid4().hex


def parse_traceparent(value: str) -> str | None:
    """The trace id of a W3C `traceparent` header, or None if it is absent or malformed.

    version-traceid-parentid-flags, lowercase hex; version ff, an all-zero trace id or
    parent id are invalid; a version 00 header has exactly four fields.
    """
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, _, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return trace_id


class RequestIdLogFilter(logging.Filter):
    """Adds `request_id` and `trace_id` to every log record (the current request's, or '-')."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.trace_id = trace_id_var.get() or "-"
        return True
