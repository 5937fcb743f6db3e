"""Tier configuration: `--kv-tiers ram:4GiB,disk:/path:20GiB,redis://127.0.0.1:6379` (no torch).

One spec per tier, in the order a prefix is looked for (RAM, then disk, then Redis, whatever
order they are written in). Every tier is off unless named. Disk and RAM take a byte budget;
options ride on a query string after any tier (`redis://host:6379/0?object_bytes=1MiB&timeout_ms=250`,
`disk:/path:20GiB?object_bytes=64KiB`). Parsing is the only place the text is read; the result is frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from ctxwarden.units import parse_bytes

TIER_KINDS = ("ram", "disk", "redis")
_OPTIONS = ("object_bytes", "timeout_ms", "batch_objects", "probe_interval_ms", "max_queue_bytes")
_EXAMPLE = "ram:4GiB,disk:/var/cache/ctxwarden:20GiB,redis://127.0.0.1:6379"


@dataclass(frozen=True)
class TierSpec:
    """One tier: its kind, byte budget (ram, disk), directory (disk) or URL (redis).

    `object_bytes` is the target size of one stored object (blocks are grouped into
    objects of about this size; at least one block each). `timeout_ms` bounds every socket
    wait of a fetch; `probe_interval_ms` paces the health probe of a tripped breaker.
    """

    kind: str
    capacity_bytes: int | None = None  # ram, disk: the hard cap; redis: its maxmemory decides
    path: str | None = None  # disk
    url: str | None = None  # redis
    object_bytes: int = 1024 * 1024
    timeout_ms: int = 250
    batch_objects: int = 8  # objects per pipelined round trip
    probe_interval_ms: int = 500
    max_queue_bytes: int = 1024**3  # pending asynchronous stores (host memory); past it they are dropped

    def __post_init__(self):
        if self.kind not in TIER_KINDS:
            raise ValueError(f"tier kind must be one of {', '.join(TIER_KINDS)}, got {self.kind!r}")
        if self.kind in ("ram", "disk") and (self.capacity_bytes is None or self.capacity_bytes < 1):
            raise ValueError(f"the {self.kind} tier needs a byte budget >= 1, got {self.capacity_bytes}; "
                             f"write e.g. {self.kind}:{'4GiB' if self.kind == 'ram' else '/path:20GiB'}")
        if self.kind == "disk" and not self.path:
            raise ValueError("the disk tier needs a directory: disk:/path:20GiB")
        if self.kind == "redis" and not self.url:
            raise ValueError("the redis tier needs a URL: redis://127.0.0.1:6379")
        for name in ("object_bytes", "timeout_ms", "batch_objects", "probe_interval_ms", "max_queue_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"tier option {name} must be >= 1, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        """The tier's label in metrics and logs: ram, disk or redis."""
        return self.kind


@dataclass(frozen=True)
class TiersConfig:
    """The configured tiers in lookup order (ram, disk, redis); empty means tiers are off."""

    tiers: tuple[TierSpec, ...] = field(default=())

    def __post_init__(self):
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"each tier kind may be named once, got {', '.join(kinds)}")
        ordered = tuple(sorted(self.tiers, key=lambda t: TIER_KINDS.index(t.kind)))
        object.__setattr__(self, "tiers", ordered)

    @property
    def is_enabled(self) -> bool:
        """Whether any tier is configured."""
        return bool(self.tiers)

    def get(self, kind: str) -> TierSpec | None:
        """The spec of one kind of tier, or None when it is not configured."""
        return next((t for t in self.tiers if t.kind == kind), None)

    def __str__(self) -> str:
        return ",".join(format_tier(t) for t in self.tiers)


def parse_tiers(text: str | None) -> TiersConfig:
    """Read `ram:4GiB,disk:/path:20GiB,redis://host:6379` (any subset, any order)."""
    if text is None or not str(text).strip():
        return TiersConfig()
    return TiersConfig(tuple(_parse_one(part.strip()) for part in str(text).split(",") if part.strip()))


def _parse_one(part: str) -> TierSpec:
    if part.startswith(("redis://", "rediss://", "unix://")):
        split = urlsplit(part)
        return TierSpec("redis", url=split._replace(query="").geturl(), **_options(split.query, part))
    head, _, query = part.rpartition("?") if "?" in part else (part, "", "")
    kind, _, rest = head.partition(":")
    if kind == "ram" and rest:
        return TierSpec("ram", capacity_bytes=parse_bytes(rest), **_options(query, part))
    if kind == "disk" and ":" in rest:
        path, size = rest.rsplit(":", 1)
        return TierSpec("disk", capacity_bytes=parse_bytes(size), path=path, **_options(query, part))
    raise ValueError(f"cannot read tier {part!r}; write tiers as {_EXAMPLE} (any of them, comma-separated)")


def _options(query: str, part: str) -> dict[str, int]:
    """`object_bytes=1MiB&timeout_ms=250` -> typed options (sizes take units)."""
    options = dict(parse_qsl(query))
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown tier option(s) {', '.join(unknown)} in {part!r}; "
                         f"the options are {', '.join(_OPTIONS)}")
    return {k: parse_bytes(v) if k.endswith("_bytes") else int(v) for k, v in options.items()}


def format_tier(t: TierSpec) -> str:
    """The text `parse_tiers` reads back into the same spec (defaults left out)."""
    defaults = TierSpec(t.kind, capacity_bytes=t.capacity_bytes, path=t.path, url=t.url)
    query = "&".join(f"{k}={getattr(t, k)}" for k in _OPTIONS if getattr(t, k) != getattr(defaults, k))
    head = {"ram": f"ram:{t.capacity_bytes}", "disk": f"disk:{t.path}:{t.capacity_bytes}"}.get(t.kind, t.url)
    return head + (f"?{query}" if query else "")
