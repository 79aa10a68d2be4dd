"""The reference server as a detached, named Ray actor: ``address: auto``.

On a Ray cluster (verl, OpenRLHF) nobody should have to start ``tensorhub
server`` by hand and wire its address into every config. The first process
that asks starts the server as a detached actor on the head node; every other
process finds the same actor by name through Ray::

    from tensorhub.server.ray_actor import resolve_address
    hub = Hub.connect(resolve_address("auto"), name="trainer-0")   # "10.0.0.5:50051"
    hub = Hub.connect(resolve_address("10.0.0.7:50051"), ...)      # explicit: passed through

* One server per ``(namespace, name)``. Ray's ``get_if_exists`` makes the
  create race safe: callers that start together all get the one actor.
* Detached: it outlives the job and the worker groups that created it (a
  trainer group that is killed and restarted finds the same server and the
  versions its holders still hold), and ends with the Ray cluster or
  :func:`shutdown_server`.
* On the head node, so it goes when the cluster goes, not when an autoscaled
  worker node leaves; ``num_cpus=0``, so it takes no scheduling slot.
* It listens on ``config.port`` (50051 by default) on all interfaces and
  advertises the node's IP. Should its process die, Ray restarts it and it
  binds the same port again (waiting up to 30 s for the dead process to let
  go of it), so clients find it at the address they have and re-register
  what they hold (the server's state is soft). If that port is busy when it
  first starts it takes a free one instead, which a restart may not get.

Ray is imported inside the functions: the rest of TensorHub never needs it.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from tensorhub.errors import ServerUnavailable
from tensorhub.server.config import ServerConfig

log = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_NAME = "tensorhub-server"
DEFAULT_NAMESPACE = "tensorhub"
# The system resource only the head node has (ray._common.constants.HEAD_NODE_RESOURCE_NAME).
_HEAD_NODE_RESOURCE = "node:__internal_head__"
_ANY_INTERFACE = ("0.0.0.0", "::", "[::]")
_RESTART_POLL_S = 0.2  # Ray answers "restarting" at once; a restart takes about a second
_REBIND_PATIENCE_S = 30.0  # a restarted server waits this long for its old port


class ReferenceServerActor:
    """Runs an :class:`~tensorhub.server.app.EmbeddedServer` in the actor's
    process; its gRPC loop has its own thread, so the actor's methods only
    report where it is."""

    def __init__(self, config: ServerConfig) -> None:
        import ray

        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._server = _bind(config, patience_s=_REBIND_PATIENCE_S if restarted else 0.0)
        self._host = config.host
        if self._host in _ANY_INTERFACE:
            self._host = ray.util.get_node_ip_address()

    def address(self) -> str:
        """``host:port`` that every node of the cluster can reach."""
        return f"{self._host}:{self._server.port}"

    def describe(self) -> dict[str, Any]:
        """The address and the server's instance id (a new one after a restart)."""
        return {"address": self.address(), "instance_id": self._server.state.instance_id}

    def stop(self) -> None:
        self._server.stop()


def _bind(config: ServerConfig, patience_s: float) -> Any:
    """An EmbeddedServer on ``config.port``, tried for ``patience_s`` (a restarted
    actor: the dead process may hold the port a moment longer); then, or at
    once on a first start, on a free port, so a busy 50051 does not stop it."""
    from tensorhub.server.app import EmbeddedServer

    deadline = time.monotonic() + patience_s
    while config.port != 0 and not _port_free(config.host, config.port) and time.monotonic() < deadline:
        time.sleep(_RESTART_POLL_S)  # probe with a plain socket: a failed EmbeddedServer leaves its thread
    try:
        return EmbeddedServer(config)
    except (OSError, RuntimeError) as e:  # grpc says RuntimeError("Failed to bind ...")
        if config.port == 0:
            raise
        log.warning("port %d is taken (%s); the reference server takes a free port instead", config.port, e)
        return EmbeddedServer(config, port=0)


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def ensure_server(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *,
                  config: ServerConfig | None = None, timeout_s: float = 60.0, on_head: bool = True) -> str:
    """The ``host:port`` of the reference server actor ``namespace/name``,
    starting it if no process has yet.

    ``config`` is used by the call that creates the actor and ignored by the
    rest (default: all interfaces, port 50051). ``on_head=False`` lets Ray
    place it on any node. Needs this process connected to Ray (any Ray worker
    is; a driver calls ``ray.init()`` first). ``ServerUnavailable`` if Ray is
    missing or the actor does not answer within ``timeout_s`` (e.g. it cannot
    be scheduled, or its server cannot bind).
    """
    ray = _ray()
    actor = _get_or_create(ray, name, namespace, config or ServerConfig(host="0.0.0.0"), on_head)
    where = f"Ray actor {namespace}/{name}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            address = ray.get(actor.address.remote(), timeout=max(0.0, deadline - time.monotonic()))
            break
        except ray.exceptions.GetTimeoutError as e:
            raise ServerUnavailable(AUTO, f"the {where} did not start within {timeout_s:.0f}s; "
                                          "is the head node there and does it have memory left?") from e
        except ray.exceptions.ActorUnavailableError as e:  # restarting: ask again until the deadline
            if time.monotonic() >= deadline:
                raise ServerUnavailable(AUTO, f"the {where} was still restarting after {timeout_s:.0f}s") from e
            time.sleep(_RESTART_POLL_S)
        except ray.exceptions.RayActorError as e:
            raise ServerUnavailable(AUTO, f"the {where} failed: {e}") from e
    log.debug("reference server %s at %s", where, address)
    return address


def resolve_address(address: str, **ensure: Any) -> str:
    """``"auto"``: :func:`ensure_server` (``ensure`` are its keyword arguments);
    anything else is taken as ``host:port`` and returned as given (``Hub.connect``
    checks it)."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"reference server address {address!r} is empty: give host:port or {AUTO!r}")
    address = address.strip()
    if address.lower() == AUTO:
        return ensure_server(**ensure)
    return address


def shutdown_server(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> bool:
    """Stop the actor ``namespace/name`` for good (no restart). False if there was none."""
    ray = _ray()
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


def _get_or_create(ray: Any, name: str, namespace: str, config: ServerConfig, on_head: bool) -> Any:
    options: dict[str, Any] = {
        "name": name, "namespace": namespace, "lifetime": "detached",
        "get_if_exists": True,  # Ray's own get-or-create: a lost create race returns the winner
        "num_cpus": 0,
        "max_restarts": -1,  # a restart binds the same port: clients keep their address
        # Outside the caller's placement group (verl's workers run in one).
        "scheduling_strategy": "DEFAULT",
    }
    if on_head:
        options["resources"] = {_HEAD_NODE_RESOURCE: 0.001}
    return ray.remote(ReferenceServerActor).options(**options).remote(config)


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ServerUnavailable(AUTO, "address 'auto' runs the server as a Ray actor, but Ray is not "
                                      "installed here: install ray, or give the server's host:port") from e
    if not ray.is_initialized():
        raise ServerUnavailable(AUTO, "address 'auto' runs the server as a Ray actor, but this process is "
                                      "not connected to Ray: call ray.init() first, or give host:port")
    return ray
