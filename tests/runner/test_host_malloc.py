"""runner/host_malloc.py: freed prefill-sized tensors are reused, not faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ctxwarden.runner.host_malloc import MMAP_THRESHOLD, tune_malloc

# In a fresh interpreter (the thresholds are process-wide): three 25 MB tensors (SmolLM2's
# gate_up output at a 2,048-token chunk) alive at once, made and freed 10 times (one alone
# would stay under the thresholds glibc raises after its first free), page faults counted.
PROBE = """
import json, resource, torch
from ctxwarden.runner.host_malloc import tune_malloc
done = tune_malloc()
def churn():
    for _ in range(10):
        live = [torch.empty(2048, 3072).fill_(1.0) for _ in range(3)]
        del live
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(json.dumps({"settings": done, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(choice: str) -> dict:
    env = {**os.environ, "CTXWARDEN_MALLOC": choice}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_malloc_reuses_freed_activations_instead_of_faulting_them_in():
    default, tuned = _probe("default"), _probe("tuned")
    if tuned["settings"] is None:
        pytest.skip("not glibc: mallopt is not available, nothing is tuned")
    assert default["settings"] is None
    assert tuned["settings"]["mmap_threshold"] == MMAP_THRESHOLD
    pages = 2048 * 3072 * 4 // 4096
    # glibc's defaults map each block afresh: every page of every block faults again
    assert default["faults"] > 10 * pages, default
    assert tuned["faults"] < pages // 10, tuned


def test_a_wrong_setting_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("CTXWARDEN_MALLOC", "jemalloc")
    tune_malloc.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"CTXWARDEN_MALLOC must be 'tuned' \(the default\) or 'default'"):
            tune_malloc()
    finally:
        tune_malloc.cache_clear()
