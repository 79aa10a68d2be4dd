"""Fixtures of the verl suite: a real reference server on 127.0.0.1 and the
engine settings that point at it. (No __init__.py here: verl's wheel installs
a top-level ``tests`` package, which ours must not shadow.)"""

from __future__ import annotations

import pytest

from tensorhub.server import EmbeddedServer


@pytest.fixture
def server():
    with EmbeddedServer() as s:
        yield s


@pytest.fixture
def engine_kwargs(server):
    return {"address": server.address, "model": "tiny/policy", "wait_timeout_s": 20.0,
            "hub": {"connect_timeout_s": 2.0, "chunk_size": 4096}}
