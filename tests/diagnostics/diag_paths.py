"""Plain helpers of the diagnostics tests (a module of its own: `from conftest import`
picks whichever conftest was imported first when test folders are collected together)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cgroup"
