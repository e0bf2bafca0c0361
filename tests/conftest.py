"""Fixtures shared by the core's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import urllib3


@pytest.fixture
def http() -> Iterator[urllib3.PoolManager]:
    """An HTTP client for loopback servers: 10 s a request, never a retry (a refused or dropped
    request is the test's to see)."""
    pool = urllib3.PoolManager(timeout=urllib3.Timeout(total=10), retries=False)
    yield pool
    pool.clear()
