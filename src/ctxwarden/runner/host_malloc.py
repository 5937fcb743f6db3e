"""glibc's malloc told to keep a step's freed activations for the next step.

A prefill step's tensors are megabytes each (SmolLM2 at a 2,048-token chunk: its gate_up
output alone is 25 MB). glibc serves such blocks with a fresh `mmap` and unmaps them on
free (above its mmap threshold, 128 KiB at first), or gives the top of the heap back to
the kernel once more than its trim threshold is free there. Either way the next step's
tensors land on new pages, and the kernel faults and zeroes every page again: a perf
profile of W1 (16 x 512 -> 128, `auto-int8act`, Zen 4, 2026-12-07) had ~12% of its
samples in page faults, page clearing and unmapping, most under the GEMM's first writes
to its output. With the mmap threshold at glibc's maximum (32 MiB: larger blocks, the KV
pool and weights among them, are still mapped on their own, so RSS tracks their use) and
the trim threshold at 512 MiB, freed activations stay in the heap and are reused. W1
measured 11.7-12.7 s default against 9.4-10.2 s tuned (two fresh processes each,
alternating; peak RSS 777-780 MB against 808-819). The cost is that memory: a process
keeps up to the threshold of freed heap instead of returning it, bounded by the largest
steps' working set. This is what PyTorch's CPU performance guide gets from jemalloc or
tcmalloc, done without preloading a library.

Applied once per process by ModelRunner (so LLM, the engine and the server get it);
CTXWARDEN_MALLOC=default leaves glibc's settings alone. A no-op where the C library is not
glibc (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """This process's C library through ctypes (errno kept), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@lru_cache(maxsize=1)
def tune_malloc() -> dict[str, int] | None:
    """Set glibc's mmap and trim thresholds (once); the settings made, or None when left
    alone (CTXWARDEN_MALLOC=default, not glibc, or glibc refused them)."""
    choice = os.environ.get("CTXWARDEN_MALLOC", "").strip().lower()
    if choice == "default":
        return None
    if choice not in ("", "tuned"):
        raise ValueError(f"CTXWARDEN_MALLOC must be 'tuned' (the default) or 'default' (glibc's own "
                         f"thresholds), got {choice!r}")
    lib = libc()
    if lib is None:
        return None
    try:
        mallopt = lib.mallopt
        lib.gnu_get_libc_version  # glibc only: musl has mallopt as a no-op stub
    except AttributeError:
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {}
    for name, param, value in (("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(param, value) == 1:  # 1 on success
            done[name] = value
    return done or None
