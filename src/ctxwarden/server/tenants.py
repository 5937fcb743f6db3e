"""Tenants: API keys map to tenants; a tenant salts the prefix cache and has its own limits.

A key file holds one key per line; `#` starts a comment:

    API_KEY TENANT_NAME [weight=W] [max_running=N] [max_queued=N] [tpm=N] [role=admin]

- `weight`: the tenant's share in fair scheduling (default 1; 2 = twice the engine time).
- `max_running`: its requests computing at once (more wait, without holding others up).
- `max_queued`: its requests waiting at once (more are refused: 429 + Retry-After).
- `tpm`: tokens per minute, prompt + max_tokens reserved at submission, unused completion
  tokens given back when the request ends (more are refused: 429 + Retry-After).
- `role=admin`: may call the /debug endpoints.

Several keys may name one tenant; their options must then agree. The engine namespace (the
prefix-cache salt) is derived from the tenant name, never taken from the client, so two
tenants never share cached KV blocks even for identical prompts. Keys are compared in
constant time against every key (no early exit reveals which one nearly matched).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ctxwarden.errors import TenantLimitExceeded
from ctxwarden.request import TenantShare

DEFAULT_TENANT = "default"
TPM_WINDOW_S = 60.0
_OPTIONS = {"weight": float, "max_running": int, "max_queued": int, "tpm": int, "role": str}

log = logging.getLogger("ctxwarden.server")


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, the namespace their KV blocks are cached under, and their limits."""

    name: str
    weight: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    is_admin: bool = False

    def __post_init__(self):
        TenantShare(self.name, self.weight, self.max_running, self.max_queued)  # validates them
        if self.tokens_per_minute is not None and self.tokens_per_minute < 1:
            raise ValueError(f"tpm must be >= 1, got {self.tokens_per_minute}")

    @property
    def namespace(self) -> str:
        """The prefix-cache salt: a digest of the tenant name (stable across restarts)."""
        return "tenant-" + hashlib.sha256(self.name.encode()).hexdigest()[:16]

    @property
    def share(self) -> TenantShare:
        """What the scheduler needs: weight and the running / queued caps."""
        return TenantShare(self.name, self.weight, self.max_running, self.max_queued)


class KeyFileError(ValueError):
    """A malformed API key file; the message names the file and the line."""


@dataclass(frozen=True)
class TenantDirectory:
    """API key -> tenant. Empty means authentication is off: one tenant for everyone."""

    tenants_by_key: dict[str, Tenant]

    @property
    def requires_key(self) -> bool:
        return bool(self.tenants_by_key)

    @classmethod
    def open(cls) -> "TenantDirectory":
        """No key file: every request is the one default tenant."""
        return cls({})

    @classmethod
    def load(cls, path: str | Path) -> "TenantDirectory":
        """Parse a key file (see the module docstring); warns if others may read it."""
        path = Path(path)
        _warn_if_readable_by_others(path)
        keys: dict[str, Tenant] = {}
        by_name: dict[str, Tenant] = {}
        for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, tenant = _parse_line(line.split(), f"{path}:{lineno}")
            if key in keys:
                raise KeyFileError(f"{path}:{lineno}: the key for tenant {tenant.name!r} is already listed "
                                   f"(for tenant {keys[key].name!r}); each key names one tenant")
            if by_name.setdefault(tenant.name, tenant) != tenant:
                raise KeyFileError(f"{path}:{lineno}: tenant {tenant.name!r} is listed with other options "
                                   "before; every key of one tenant must give the same options")
            keys[key] = tenant
        if not keys:
            raise KeyFileError(f"{path}: no 'API_KEY TENANT_NAME' lines; without keys, omit --api-keys")
        return cls(keys)

    def resolve(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header; None if missing or unknown."""
        if not self.requires_key:
            return Tenant(DEFAULT_TENANT)
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        given = authorization[7:].strip().encode()
        found = None
        for key, tenant in self.tenants_by_key.items():  # every key, whatever matched
            if hmac.compare_digest(key.encode(), given):
                found = tenant
        return found

    @property
    def tenants(self) -> list[Tenant]:
        """Every distinct tenant of the key file."""
        return list({t.name: t for t in self.tenants_by_key.values()}.values())


def _parse_line(fields: list[str], where: str) -> tuple[str, Tenant]:
    if len(fields) < 2 or any("=" not in f for f in fields[2:]):
        raise KeyFileError(f"{where}: expected 'API_KEY TENANT_NAME', got {len(fields)} field(s) (options "
                           f"after the tenant are name=value: {', '.join(_OPTIONS)})")
    options = {}
    for f in fields[2:]:
        name, value = f.split("=", 1)
        if name not in _OPTIONS:
            raise KeyFileError(f"{where}: unknown option {name!r}; the options are {', '.join(_OPTIONS)}")
        try:
            options[name] = _OPTIONS[name](value)
        except ValueError:
            raise KeyFileError(f"{where}: {name}={value!r} is not a {_OPTIONS[name].__name__}") from None
    if options.get("role", "admin") != "admin":
        raise KeyFileError(f"{where}: role={options['role']!r}; the only role is 'admin'")
    try:
        return fields[0], Tenant(fields[1], options.get("weight", 1.0), options.get("max_running"),
                                 options.get("max_queued"), options.get("tpm"), "role" in options)
    except ValueError as e:
        raise KeyFileError(f"{where}: {e}") from None


def _warn_if_readable_by_others(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("API key file %s is readable by other users (mode %o); run: chmod 600 %s",
                    path, stat.S_IMODE(mode), path)


class TokenRateLimiter:
    """Tokens per minute per tenant: reservations in a sliding 60 s window (thread-safe).

    `reserve` books prompt + max_tokens at submission or raises TenantLimitExceeded with the
    seconds until enough of the window has expired; `refund` gives back what was not used.
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._booked: dict[str, deque] = {}  # tenant -> [(time, tokens)], oldest first

    def reserve(self, tenant: Tenant, num_tokens: int) -> None:
        """Book `num_tokens` for `tenant`, or raise if that would pass its tpm."""
        limit = tenant.tokens_per_minute
        if limit is None:
            return
        with self._lock:
            window = self._window(tenant.name)
            used = sum(n for _, n in window)
            if used + num_tokens > limit:
                raise TenantLimitExceeded(tenant.name, "tokens per minute", used + num_tokens, limit,
                                          self._seconds_until_room(window, used + num_tokens - limit))
            window.append([self._clock(), num_tokens])

    def refund(self, tenant: Tenant, num_tokens: int) -> None:
        """Give back tokens booked but not used (the newest booking absorbs it)."""
        if tenant.tokens_per_minute is None or num_tokens <= 0:
            return
        with self._lock:
            window = self._window(tenant.name)
            if window:
                window[-1][1] = max(0, window[-1][1] - num_tokens)

    def _window(self, name: str) -> deque:
        window = self._booked.setdefault(name, deque())
        horizon = self._clock() - TPM_WINDOW_S
        while window and window[0][0] <= horizon:
            window.popleft()
        return window

    def _seconds_until_room(self, window: deque, excess: int) -> float:
        freed = 0
        for at, n in window:
            freed += n
            if freed >= excess:
                return at + TPM_WINDOW_S - self._clock()
        return TPM_WINDOW_S  # more than a whole window: at least a full minute
