"""The memory cgroup of a process: cgroup v2 files, or the v1 controller where v2 is absent.

cgroup v2 (the unified hierarchy: `cgroup.controllers` at the root) gives memory.current,
memory.max, memory.peak (kernel 5.19+), memory.stat, memory.events and PSI memory.pressure.
A machine without v2 says so (`CgroupLookup.reason`); if it has the v1 memory controller
(`<root>/memory/`), its usage, limit, peak, stat and oom_kill count are read instead, with
system-wide PSI from /proc/pressure/memory. The root is configurable so tests can point it
at fixture files; the process's cgroup path comes from /proc/PID/cgroup and the nearest
directory at or above it that has the files is used (inside a container the path is often
"/" and the root is the container's own cgroup).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
SYSTEM_PRESSURE = "/proc/pressure/memory"
_V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """Memory figures of one cgroup. None: the kernel does not expose that figure here."""

    version: int  # 2, or 1 for the legacy memory controller
    path: str  # the directory read
    memory_current_bytes: int | None
    memory_max_bytes: int | None  # None: no limit ("max")
    memory_high_bytes: int | None
    memory_peak_bytes: int | None
    swap_current_bytes: int | None
    swap_max_bytes: int | None
    stat: dict[str, int]  # memory.stat as the kernel names it (bytes, or event counts: see docs)
    events: dict[str, int]  # memory.events (v1: oom_kill from memory.oom_control)
    pressure: dict[str, dict[str, float]] | None  # {"some"|"full": {avg10, avg60, avg300, total_us}}
    pressure_scope: str | None  # "cgroup", "system" (v1: /proc/pressure/memory) or None

    @property
    def headroom_bytes(self) -> int | None:
        """memory.max - memory.current; None without a limit."""
        if self.memory_max_bytes is None or self.memory_current_bytes is None:
            return None
        return self.memory_max_bytes - self.memory_current_bytes

    def to_dict(self) -> dict:
        """JSON-ready, with headroom_bytes."""
        return {**asdict(self), "headroom_bytes": self.headroom_bytes}


@dataclass(frozen=True)
class CgroupLookup:
    """The cgroup found for a process, or why none was read."""

    memory: CgroupMemory | None
    reason: str | None  # set when memory is None, or when v1 stands in for a missing v2


def lookup_cgroup(pid: int | str = "self", cgroup_root: str | Path = DEFAULT_CGROUP_ROOT,
                  proc_root: str | Path = "/proc") -> CgroupLookup:
    """Find and read the memory cgroup of `pid` under `cgroup_root` (never raises on absence)."""
    root = Path(cgroup_root)
    paths = _proc_cgroup_paths(Path(proc_root) / str(pid) / "cgroup")
    if (root / "cgroup.controllers").is_file():
        found = _nearest(root, paths.get("", "/"), "memory.stat")
        if found is None:
            return CgroupLookup(None, f"cgroup v2 at {root} has no memory controller here "
                                      "(no memory.stat at or above the process's cgroup)")
        return CgroupLookup(read_cgroup_v2(found), None)
    no_v2 = f"no cgroup v2 at {root} (no cgroup.controllers)"
    found = _nearest(root / "memory", paths.get("memory", "/"), "memory.limit_in_bytes")
    if found is None:
        return CgroupLookup(None, no_v2 + " and no cgroup v1 memory controller")
    return CgroupLookup(read_cgroup_v1(found), no_v2 + "; read the v1 memory controller instead "
                                                       "(no memory.events, PSI is system-wide)")


def find_cgroup_dir(marker: str, v1_controller: str, pid: int | str = "self",
                    cgroup_root: str | Path = DEFAULT_CGROUP_ROOT, proc_root: str | Path = "/proc") -> Path | None:
    """The process's cgroup directory holding file `marker` (v2), else under `root/v1_controller`."""
    root = Path(cgroup_root)
    paths = _proc_cgroup_paths(Path(proc_root) / str(pid) / "cgroup")
    if (root / "cgroup.controllers").is_file():
        return _nearest(root, paths.get("", "/"), marker)
    return _nearest(root / v1_controller, paths.get(v1_controller, "/"), marker)


def read_cgroup_v2(path: Path) -> CgroupMemory:
    """Read a cgroup v2 directory's memory files (absent files give None / empty)."""
    pressure = _read_pressure(path / "memory.pressure")
    return CgroupMemory(
        version=2, path=str(path), memory_current_bytes=_read_limit(path / "memory.current"),
        memory_max_bytes=_read_limit(path / "memory.max"), memory_high_bytes=_read_limit(path / "memory.high"),
        memory_peak_bytes=_read_limit(path / "memory.peak"),
        swap_current_bytes=_read_limit(path / "memory.swap.current"),
        swap_max_bytes=_read_limit(path / "memory.swap.max"), stat=_read_flat_keyed(path / "memory.stat"),
        events=_read_flat_keyed(path / "memory.events"), pressure=pressure,
        pressure_scope="cgroup" if pressure is not None else None)


def read_cgroup_v1(path: Path, system_pressure: str | Path = SYSTEM_PRESSURE) -> CgroupMemory:
    """Read a cgroup v1 memory-controller directory into the same shape as v2."""
    limit = _read_limit(path / "memory.limit_in_bytes")
    oom = _read_flat_keyed(path / "memory.oom_control")
    pressure = _read_pressure(Path(system_pressure))
    return CgroupMemory(
        version=1, path=str(path), memory_current_bytes=_read_limit(path / "memory.usage_in_bytes"),
        memory_max_bytes=None if limit is None or limit >= _V1_UNLIMITED else limit, memory_high_bytes=None,
        memory_peak_bytes=_read_limit(path / "memory.max_usage_in_bytes"), swap_current_bytes=None,
        swap_max_bytes=None, stat=_read_flat_keyed(path / "memory.stat"),
        events={"oom_kill": oom["oom_kill"]} if "oom_kill" in oom else {}, pressure=pressure,
        pressure_scope="system" if pressure is not None else None)


def _proc_cgroup_paths(path: Path) -> dict[str, str]:
    """/proc/PID/cgroup -> {controller: path}; the v2 line ("0::/x") has controller ''."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in lines:
        _, controllers, cg_path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name.removeprefix("name=")] = cg_path
    return out


def _nearest(root: Path, cg_path: str, marker: str) -> Path | None:
    """The deepest directory from root/cg_path up to root that holds `marker`."""
    here = root / cg_path.lstrip("/")
    while True:
        if (here / marker).is_file():
            return here
        if here == root or root not in here.parents:
            return None
        here = here.parent


def _read_limit(path: Path) -> int | None:
    """A one-number file; "max" and absent files are None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _read_flat_keyed(path: Path) -> dict[str, int]:
    """'key value' lines (memory.stat, memory.events, memory.oom_control) -> dict."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines if line.strip())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


def _read_pressure(path: Path) -> dict[str, dict[str, float]] | None:
    """PSI lines 'some avg10=0.00 avg60=0.00 avg300=0.00 total=123' -> nested dict (total in us)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        kind, *fields = line.split()
        values = dict(f.split("=", 1) for f in fields)
        out[kind] = {"avg10": float(values["avg10"]), "avg60": float(values["avg60"]),
                     "avg300": float(values["avg300"]), "total_us": float(values["total"])}
    return out
