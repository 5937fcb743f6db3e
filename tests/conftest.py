"""Shared test setup: OpenMP must not spin on these 2 shared cores (set before torch loads)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
