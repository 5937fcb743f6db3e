"""One process's memory: RSS, USS, PSS (psutil) and RssAnon / RssFile / RssShmem / VmSwap.

Why these: RSS counts file pages (memory-mapped weights) that the kernel can drop and share;
USS is what killing the process would free; PSS splits shared pages between their users.
A leak shows in anonymous memory, so the slow-leak detector watches RssAnon + VmSwap (a page
pushed to swap is still held), `leak_basis_bytes` here.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ctxwarden.errors import NoSuchProcess

_STATUS_FIELDS = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes",
                  "RssShmem": "rss_shmem_bytes", "VmSwap": "swap_bytes", "VmHWM": "peak_rss_bytes"}


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in bytes. USS/PSS are None when smaps cannot be read."""

    pid: int
    rss_bytes: int
    vms_bytes: int
    uss_bytes: int | None
    pss_bytes: int | None
    rss_anon_bytes: int
    rss_file_bytes: int
    rss_shmem_bytes: int
    swap_bytes: int
    peak_rss_bytes: int  # VmHWM: the highest RSS so far
    num_threads: int

    @property
    def leak_basis_bytes(self) -> int:
        """RssAnon + VmSwap: the memory a leak grows (file pages come and go on their own)."""
        return self.rss_anon_bytes + self.swap_bytes

    def to_dict(self) -> dict:
        """JSON-ready, with leak_basis_bytes."""
        return {**asdict(self), "leak_basis_bytes": self.leak_basis_bytes}


def read_proc_status(pid: int | None = None) -> dict[str, int]:
    """The RssAnon / RssFile / RssShmem / VmSwap / VmHWM lines of /proc/PID/status, in bytes.

    Raises NoSuchProcess naming the pid when the process is gone.
    """
    pid = pid if pid is not None else os.getpid()
    path = Path("/proc") / str(pid) / "status"
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(pid, f"{path} does not exist") from None
    out = {name: 0 for name in _STATUS_FIELDS.values()}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _STATUS_FIELDS:
            out[_STATUS_FIELDS[key]] = int(rest.split()[0]) * 1024  # the kernel writes kB
    return out


def read_leak_basis_bytes(pid: int | None = None) -> int:
    """RssAnon + VmSwap of `pid` (default: this process), cheaply: one read of /proc/PID/status."""
    status = read_proc_status(pid)
    return status["rss_anon_bytes"] + status["swap_bytes"]


def read_process_memory(pid: int | None = None) -> ProcessMemory:
    """Every figure above for `pid` (default: this process)."""
    import psutil

    pid = pid if pid is not None else os.getpid()
    try:
        proc = psutil.Process(pid)
        basic = proc.memory_info()
        num_threads = proc.num_threads()
    except psutil.NoSuchProcess:
        raise NoSuchProcess(pid) from None
    try:
        full = proc.memory_full_info()  # reads smaps_rollup: denied for other users' processes
        uss, pss = full.uss, getattr(full, "pss", None)
    except psutil.AccessDenied:
        uss = pss = None
    return ProcessMemory(pid=pid, rss_bytes=basic.rss, vms_bytes=basic.vms, uss_bytes=uss, pss_bytes=pss,
                         num_threads=num_threads, **read_proc_status(pid))
