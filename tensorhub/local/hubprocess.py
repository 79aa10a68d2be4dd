"""A Hub in its own OS process, driven over a pipe: what the benchmarks, the
demo and the tests start for every trainer and reader. The calls it answers are
``tensorhub.local.hubcalls``."""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from typing import TYPE_CHECKING, Any

import torch

from tensorhub import processes
from tensorhub.local.hubcalls import HANDLERS

if TYPE_CHECKING:
    from typing_extensions import Self


class RemoteError(Exception):
    """An exception raised inside a HubProcess; ``type_name`` is its class name."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}\n--- in the hub process ---\n{tb}")
        self.type_name = type_name
        self.message = message


def _hub_main(conn: Any, address: str, config: dict, netns: str | None, env: dict[str, str]) -> None:
    if netns:  # before any thread (NIXL, grpc) starts: they inherit the namespace
        from tensorhub.netns import enter

        enter(netns)
    os.environ.update(env)  # read by UCX when the agent is created
    from tensorhub import Hub

    torch.set_num_threads(1)
    hub = Hub.connect(address, **config)
    held: dict[tuple[str, int], Any] = {}
    conn.send(("ok", hub.agent_id))
    while True:
        method, kwargs = conn.recv()
        try:
            if method == "close":
                hub.close()
                conn.send(("ok", None))
                return
            result = HANDLERS[method](hub, held, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001  report every failure to the test
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))


class HubProcess:
    """A Hub in its own OS process. Calls block until the child answers or the
    timeout passes (then TimeoutError); child exceptions come back as RemoteError."""

    def __init__(self, address: str, *, name: str, start_timeout: float = 180.0, netns: str | None = None,
                 env: dict[str, str] | None = None, **config: Any) -> None:
        ctx = processes.context()
        self._conn, child = ctx.Pipe()
        self.name = name
        self.process = ctx.Process(target=_hub_main,
                                   args=(child, address, {"name": name, **config}, netns, env or {}),
                                   name=f"hub-{name}", daemon=True)
        self.process.start()
        self.agent_id = self._wait(start_timeout)

    def _wait(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"hub process {self.name} did not answer within {timeout} s")
        status, payload = self._conn.recv()
        if status == "err":
            raise RemoteError(*payload)
        return payload

    def send(self, method: str, **kwargs: Any) -> None:
        """Start a call without waiting; collect it with ``result()``."""
        self._conn.send((method, kwargs))

    def result(self, timeout: float = 120.0) -> Any:
        return self._wait(timeout)

    def call(self, method: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        self.send(method, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self, timeout: float = 30.0) -> None:
        if self.process.is_alive():
            # A child that cannot close cleanly is killed below.
            with contextlib.suppress(TimeoutError, EOFError, BrokenPipeError, RemoteError):
                self.call("close", timeout=timeout)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

