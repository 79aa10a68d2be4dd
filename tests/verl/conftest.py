"""Fixtures of the verl suite: a real reference server on 127.0.0.1 and the
engine settings that point at it. (No __init__.py here: verl's wheel installs
a top-level ``tests`` package, which ours must not shadow.)"""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (``address: auto`` runs the
    reference server as an actor on it); its detached actors end with it."""
    import ray

    os.environ.setdefault("RAY_enable_worker_prestart", "0")  # 2 cores: no idle workers
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="tests")
    yield ray
    ray.shutdown()
