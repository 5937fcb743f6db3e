"""Fixtures for the KV tests; the plain helpers are in kv_layouts.py."""

import pytest
from kv_layouts import FakeClock


@pytest.fixture
def clock():
    return FakeClock()
