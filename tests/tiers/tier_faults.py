"""Real faults for the tier tests: a full filesystem (a small tmpfs)."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager

import pytest


@contextmanager
def tmpfs(mount, size: str):
    """A real tmpfs of `size` mounted on `mount` (root can mount one; CI runs as root)."""
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs to fill ({done.stderr.decode().strip()}); run the tests as root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
