"""Hand the freed heap of a step's temporaries back to the kernel (issue 17).

What grew: every forward step allocates temporaries (activations, dequantized weights,
gathered K/V) whose sizes follow the step's row count, and frees them at its end. glibc
keeps freed chunks in its arenas for reuse: its mmap threshold rises to the largest chunk
freed (up to 32 MiB), so even a 25 MB activation lands in an arena, and a freed page in the
middle of an arena stays resident until `malloc_trim`. With the steps' sizes changing
from request to request, the retained free space drifted upwards. Measured in-process
(benchmarks/heap_retention.py, SmolLM2, the issue-17 test's load): bytes in use
(mallinfo2 `uordblks`) stayed at 425 MB over 96 requests of new lengths while free bytes
held by the arenas moved 102 -> 165 MB; `malloc_trim(0)` brought RssAnon back to 546-570 MB
every time. So it is allocator retention, not a reference kept anywhere.

The fix: trim when the engine goes idle (the retained pages are of no use until the next
request, and a trim costs ~10-30 ms), and under sustained load at most every
`interval_s` (the retention is then bounded by what builds up in that time; the re-fault
of the ~45 MB handed back is a fraction of one prefill step). A fixed M_MMAP_THRESHOLD
bounded it too, but mmaps and faults every large temporary of every step (prefill 40%
slower, measured in round 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ctxwarden.diagnostics.leaks import trim_probe

TRIM_INTERVAL_S = 30.0


@dataclass
class HeapTrimmer:
    """Calls malloc_trim(0) after the step that makes the engine idle, and every
    `interval_s` under load; counts the trims and the RssAnon + swap bytes they released."""

    interval_s: float = TRIM_INTERVAL_S
    num_trims: int = 0
    released_bytes: int = 0
    is_available: bool = True  # False after a trim found no glibc (nothing to call)
    _last: float = field(default_factory=time.monotonic)

    def after_step(self, idle: bool, now: float | None = None) -> None:
        """Trim if the engine just went idle, or if the last trim is `interval_s` old."""
        now = time.monotonic() if now is None else now
        if not self.is_available or (not idle and now - self._last < self.interval_s):
            return
        result = trim_probe()
        self.is_available, self._last = result.is_available, now
        if result.is_available:
            self.num_trims += 1
            self.released_bytes += max(0, result.released_bytes)
