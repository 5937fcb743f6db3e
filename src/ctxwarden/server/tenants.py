"""Tenants: API keys map to tenant names; the tenant salts the prefix cache.

A key file holds one `API_KEY TENANT_NAME` pair per line; `#` starts a comment. The
engine namespace (the prefix-cache salt) is derived here from the tenant name, never taken
from the client, so two tenants never share cached KV blocks even for identical prompts.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, and the namespace their KV blocks are cached under."""

    name: str

    @property
    def namespace(self) -> str:
        """The prefix-cache salt: a digest of the tenant name (stable across restarts)."""
        return "tenant-" + hashlib.sha256(self.name.encode()).hexdigest()[:16]


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
        """Parse a key file (`API_KEY TENANT_NAME` per line, `#` comments)."""
        path = Path(path)
        keys: dict[str, Tenant] = {}
        for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2:
                raise KeyFileError(f"{path}:{lineno}: expected 'API_KEY TENANT_NAME', got {len(fields)} field(s)")
            key, tenant = fields
            if key in keys:
                raise KeyFileError(f"{path}:{lineno}: the key for tenant {tenant!r} is already listed "
                                   f"(for tenant {keys[key].name!r}); each key names one tenant")
            keys[key] = Tenant(tenant)
        if not keys:
            raise KeyFileError(f"{path}: no 'API_KEY TENANT_NAME' lines; without keys, omit --api-keys")
        return cls(keys)

    def resolve(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header; None if missing or unknown."""
        if not self.requires_key:
            return Tenant(DEFAULT_TENANT)
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        given = authorization[7:].strip()
        for key, tenant in self.tenants_by_key.items():
            if hmac.compare_digest(key.encode(), given.encode()):  # constant-time per key
                return tenant
        return None
