"""``address: auto``: the reference server as a detached, named Ray actor
(tensorhub/server/ray_actor.py), on a real local Ray cluster. Worker groups are
plain Ray actors in their own processes holding real Hubs (real NIXL)."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from tensorhub import Hub, ServerUnavailable
from tensorhub.server import ServerConfig
from tensorhub.server.ray_actor import AUTO, ensure_server, resolve_address, shutdown_server
from tensorhub.testing import free_port

NAMESPACE = f"tensorhub-test-{os.getpid()}"  # apart from any real server on this cluster


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield ray_cluster
    shutdown_server(namespace=NAMESPACE)


@pytest.fixture
def config():
    return ServerConfig(host="0.0.0.0", port=free_port())


@ray.remote(num_cpus=0)
class Worker:
    """One member of a worker group: finds the server through ``auto`` and holds a Hub."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hub = None

    def connect(self, config: ServerConfig) -> str:
        address = resolve_address(AUTO, namespace=NAMESPACE, config=config, timeout_s=60)
        self.hub = Hub.connect(address, name=self.name)
        return address

    def publish(self, version: int) -> None:
        self.hub.publish("m", version, {"w": torch.full((256,), float(version))})

    def pull(self, version: int) -> float:
        result = self.hub.pull("m", version, serve=True)
        self._keep = result  # keep serving it
        return float(result.tensors["w"].sum())

    def versions(self) -> list[int]:
        return self.hub.versions("m")


def test_explicit_address_passes_through_without_ray():
    assert resolve_address(" 10.0.0.5:50051 ") == "10.0.0.5:50051"
    with pytest.raises(ValueError, match="empty"):
        resolve_address("")


def test_auto_before_ray_init_says_what_to_do():
    if ray.is_initialized():
        pytest.skip("Ray was started by an earlier test in this process")
    with pytest.raises(ServerUnavailable, match=r"not connected to Ray: call ray\.init\(\) first, or give host:port"):
        resolve_address("auto")


def test_groups_find_one_server_that_outlives_them(cluster, config):
    trainers = [Worker.remote(f"trainer-{i}") for i in range(2)]
    rollouts = [Worker.remote(f"rollout-{i}") for i in range(2)]
    # All four ask at once: one of them creates the actor, the rest find it.
    addresses = ray.get([w.connect.remote(config) for w in trainers + rollouts], timeout=120)
    assert len(set(addresses)) == 1 and addresses[0].endswith(f":{config.port}")
    before = ray.get(ray.get_actor("tensorhub-server", namespace=NAMESPACE).describe.remote(), timeout=30)

    ray.get(trainers[0].publish.remote(1), timeout=60)
    assert ray.get([r.pull.remote(1) for r in rollouts], timeout=120) == [256.0, 256.0]

    # The trainer group goes away (killed, as a crashed job would) and a new one starts.
    for w in trainers:
        ray.kill(w)
    again = Worker.remote("trainer-restarted")
    assert ray.get(again.connect.remote(ServerConfig(port=free_port())), timeout=120) == addresses[0]
    after = ray.get(ray.get_actor("tensorhub-server", namespace=NAMESPACE).describe.remote(), timeout=30)
    assert after == before  # the same server, not a new one
    # version 1 is still held by the rollouts that pulled it, so it stays listed
    assert ray.get(again.versions.remote(), timeout=30) == [1]
    ray.get(again.publish.remote(2), timeout=60)
    assert ray.get(rollouts[0].pull.remote(2), timeout=60) == 512.0
    # The driver resolves the same address too
    assert ensure_server(namespace=NAMESPACE) == addresses[0]


def test_a_restarted_server_keeps_its_address_and_clients_re_register(cluster):
    name = "restarting"
    config = ServerConfig(host="0.0.0.0", port=free_port())
    address = ensure_server(name, NAMESPACE, config=config)
    hub = Hub.connect(address, name="driver")
    try:
        hub.publish("m", 7, {"w": torch.ones(16)})
        actor = ray.get_actor(name, namespace=NAMESPACE)
        first = ray.get(actor.describe.remote(), timeout=30)["instance_id"]
        ray.kill(actor, no_restart=False)  # its process dies; Ray restarts it
        deadline = time.monotonic() + 60
        while True:  # until the new incarnation answers (the old one may for a moment)
            try:
                now = ray.get(actor.describe.remote(), timeout=60)
                if now["instance_id"] != first:
                    break
            except ray.exceptions.ActorUnavailableError:
                pass
            assert time.monotonic() < deadline, "the server actor was not restarted"
            time.sleep(0.2)
        assert now["address"] == address and ensure_server(name, NAMESPACE) == address
        # soft state: the driver's Hub notices the new instance and re-registers version 7
        assert hub.wait_for_version("m", 7, timeout=20) == 7
    finally:
        hub.close()
        assert shutdown_server(name, NAMESPACE)
    assert not shutdown_server(name, NAMESPACE)  # gone for good
