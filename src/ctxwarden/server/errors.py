"""Every refusal as an OpenAI error object: {"error": {"message", "type", "param", "code"}}.

The rule behind the statuses: an error that will not succeed on retry is a 4xx other than
429 (context_length_exceeded and kv_capacity_exceeded are 400s: the same request can never
fit); only overload (429, queue full) and unavailability (503, loading or draining) invite a
retry, and both carry Retry-After.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ctxwarden.errors import (ContextLengthExceeded, EngineFailed, InvalidSamplingParams,
                              KVCapacityExceeded, Overloaded, QueueDelayExceeded, QueueFull,
                              TenantLimitExceeded)

log = logging.getLogger("ctxwarden.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    """An HTTP error the API returns as an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def response(self) -> JSONResponse:
        """The JSON response with this error's status, body and headers."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def unavailable(message: str) -> APIError:
    """503 with Retry-After: the server is loading or draining."""
    return APIError(503, message, "service_unavailable", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def from_engine_error(e: Exception, prompt_param: str) -> APIError:
    """Map an error raised by `Engine.add_request` or `SamplingParams` to its API error."""
    if isinstance(e, ContextLengthExceeded):
        return APIError(400, str(e), param=prompt_param, code="context_length_exceeded",
                        headers={"x-context-window": str(e.max_model_len)})
    if isinstance(e, KVCapacityExceeded):
        return APIError(400, str(e), param=prompt_param, code="kv_capacity_exceeded")
    if isinstance(e, Overloaded):
        code = {QueueFull: "queue_full", QueueDelayExceeded: "queue_delay_exceeded",
                TenantLimitExceeded: "tenant_limit_exceeded"}.get(type(e), "overloaded")
        return APIError(429, str(e), "rate_limit_exceeded", code=code,
                        headers={"Retry-After": str(max(RETRY_AFTER_S, math.ceil(e.retry_after_s)))})
    if isinstance(e, EngineFailed):  # the engine thread died: retry after the restart
        return APIError(503, f"The engine failed ({e}); the server is restarting. Retry shortly.",
                        "service_unavailable", code="engine_failed", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, InvalidSamplingParams):
        return APIError(400, str(e), param=e.field, code="invalid_value")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=prompt_param, code="invalid_value")
    log.exception("unexpected error while submitting a request")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error")


def overflow_error(e: ContextLengthExceeded, prompt_param: str, policy: str, has_fallback: bool) -> APIError:
    """The 400 of a prompt over the window under `policy` (error, or fallback with nowhere to go)."""
    err = from_engine_error(e, prompt_param)
    if policy == "fallback" and not has_fallback:
        err.message = ("on_overflow 'fallback' needs a fallback model, and this server has none (start it with "
                       "--fallback-model DIR); or send another on_overflow. " + err.message)
    elif policy == "error":
        err.message += (' To have the server shorten it, send "ctxwarden": {"on_overflow": POLICY} with POLICY '
                        "one of truncate-head, truncate-middle, keep-tail-semantic, fallback.")
    return err


def _param_of(loc: tuple) -> str | None:
    """`('body', 'messages', 0, 'role')` -> `messages[0].role`; None for the body itself."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _is_type_tag(p):
            out += f".{p}" if out else str(p)
    return out or None


def _is_type_tag(part: str) -> bool:
    # pydantic puts union branch names ('str', 'list[int]', 'constrained-str') into loc;
    # request fields are plain identifiers.
    return not part.isidentifier() or part in {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(exc: RequestValidationError) -> APIError:
    """A pydantic/JSON error as a 400 naming the first offending parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
    if first.get("type") == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {first.get('msg')} "
                        f"(at position {first.get('loc', ('', '?'))[-1]}).", param="body", code="invalid_json")
    param = _param_of(tuple(first.get("loc", ())))
    where = f"'{param}'" if param else "the body"
    more = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return APIError(400, f"Invalid value for {where}: {first.get('msg')}{more}.", param=param or "body",
                    code="invalid_value" if param else "invalid_body")


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        param = "body" if exc.status_code == 400 else None  # FastAPI's "error parsing the body"
        return APIError(exc.status_code, str(exc.detail), kind, param=param,
                        code=kind if exc.status_code == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error",
                        code="internal_error").response()
