"""What `doctor` reports about the machine: Python, torch, threads, OpenMP, CPU flags, limits.

torch is asked in a child interpreter (same executable, same environment), so this module
never imports it and its answer is the one a fresh `ctxwarden serve` would get: threads,
inter-op threads, ATen's CPU capability and its parallel backend.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ctxwarden.diagnostics.cgroup import DEFAULT_CGROUP_ROOT, find_cgroup_dir, lookup_cgroup

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT",
              "OMP_PROC_BIND", "KMP_AFFINITY")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
_TORCH_PROBE = """
import json, torch
info = torch.__config__.parallel_info()
backend = next((l.split(":", 1)[1].strip() for l in info.splitlines() if "parallel backend" in l), None)
print(json.dumps({"version": torch.__version__, "num_threads": torch.get_num_threads(),
                  "num_interop_threads": torch.get_num_interop_threads(),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "parallel_backend": backend, "mkldnn": torch.backends.mkldnn.is_available()}))
"""


@dataclass(frozen=True)
class Environment:
    """The environment section of `doctor --json` (docs/diagnostics.md)."""

    python: dict
    platform: dict
    torch: dict  # {"version", "num_threads", ...} or {"error": why it could not be asked}
    threads: dict  # cpus online / allowed (affinity) / cgroup quota, and the thread env vars
    openmp_wait_policy: str | None  # in effect here, and for a `ctxwarden serve` started like this
    openmp_wait_policy_user: str | None  # as set in the shell (ctxwarden commands default to PASSIVE)
    cpu: dict  # {"model", "flags": {flag: bool}}
    memory: dict  # machine totals (psutil)
    cgroup: dict | None
    cgroup_note: str | None

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)


def collect_environment(cgroup_root: str = DEFAULT_CGROUP_ROOT, probe_torch: bool = True,
                        user_env: dict[str, str | None] | None = None) -> Environment:
    """Read everything above; torch is asked in a child process (module doc).

    `user_env`: the environment before the ctxwarden CLI applied its defaults
    (ctxwarden.cli.USER_ENV); without it, the environment as it is now.
    """
    import psutil

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    found = lookup_cgroup("self", cgroup_root)
    return Environment(
        python={"version": platform.python_version(), "implementation": platform.python_implementation(),
                "executable": sys.executable},
        platform={"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                  "libc": " ".join(platform.libc_ver()).strip() or None},
        torch=probe_torch_runtime() if probe_torch else {"error": "not probed"},
        threads={"cpus_online": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)),
                 "cpu_quota": cpu_quota(cgroup_root), "env": {k: os.environ.get(k) for k in THREAD_ENV}},
        openmp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        openmp_wait_policy_user=(user_env if user_env is not None else os.environ).get("OMP_WAIT_POLICY"),
        cpu=read_cpu(), memory={"total_bytes": vm.total, "available_bytes": vm.available,
                                "swap_total_bytes": swap.total, "swap_used_bytes": swap.used},
        cgroup=found.memory.to_dict() if found.memory else None, cgroup_note=found.reason)


def probe_torch_runtime(timeout_s: float = 120.0) -> dict:
    """Ask a fresh interpreter for torch's threads, capability and backend."""
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch took over {timeout_s:g} s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"torch could not be imported: {last}"}
    return json.loads(out.stdout)


def read_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """CPU model name and which of CPU_FLAGS the first processor lists."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {"model": platform.processor() or None, "flags": {}}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "flags": {f: f in flags for f in CPU_FLAGS}}


def cpu_quota(cgroup_root: str | Path = DEFAULT_CGROUP_ROOT, pid: int | str = "self") -> float | None:
    """CPUs the process's cgroup may use (quota / period); None without a quota or a cpu controller."""
    v2 = find_cgroup_dir("cpu.max", "cpu", pid, cgroup_root)
    try:
        if v2 is not None:
            quota, period = (v2 / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        v1 = find_cgroup_dir("cpu.cfs_quota_us", "cpu", pid, cgroup_root)
        if v1 is None:
            return None
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
