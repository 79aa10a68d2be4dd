"""Fixtures for the core suite: a real reference server on 127.0.0.1 and Hubs
in real separate OS processes (spawned), talking real NIXL."""

from __future__ import annotations

import pytest

from tensorhub.server import EmbeddedServer
from tensorhub.testing import HubProcess


@pytest.fixture
def server():
    """Retention off: unpublish of the last copy makes a version unpullable.
    test_retention.py covers the default (the latest version is retained)."""
    with EmbeddedServer(lease_ttl_s=5.0, retain=0) as srv:
        yield srv


@pytest.fixture
def retaining_server():
    with EmbeddedServer(lease_ttl_s=5.0, retain=1) as srv:
        yield srv


@pytest.fixture
def hubs(server):
    """Factory: ``hubs("trainer")`` starts a Hub in its own process."""
    started: list[HubProcess] = []

    def start(name: str, address: str | None = None, **config) -> HubProcess:
        proc = HubProcess(address or server.address, name=name, **config)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.close(timeout=15)
