"""API key files for server tests (a module of its own: test files cannot import conftest)."""

from __future__ import annotations

from pathlib import Path


def admin_and_alpha_keys(root: Path) -> Path:
    """A key file with an admin ("ops", key-admin) and a plain tenant ("alpha", key-alpha), 0600."""
    keys = root / "keys.txt"
    keys.write_text("key-admin ops role=admin\nkey-alpha alpha\n")
    keys.chmod(0o600)
    return keys
