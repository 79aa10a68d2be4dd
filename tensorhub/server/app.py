"""Running the reference server: as a process (``tensorhub server``) or
embedded in a background thread (demo, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from typing import TYPE_CHECKING, Any

import grpc

from tensorhub.server.auth import TlsFiles, TokenInterceptor
from tensorhub.server.config import ServerConfig
from tensorhub.server.metrics import NoMetrics, PrometheusMetrics
from tensorhub.server.service import ReferenceService, add_to_server
from tensorhub.server.state import State

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)


def _metrics(state: State) -> NoMetrics:
    """Prometheus metrics over HTTP when ``metrics_port`` is set, else nothing."""
    config = state.config
    if config.metrics_port is None:
        return NoMetrics()
    return PrometheusMetrics(state, config.host, config.metrics_port)


async def _start(state: State, metrics: NoMetrics) -> tuple[grpc.aio.Server, int]:
    config = state.config
    # The token is checked before any handler runs (auth.py); none: anyone may call.
    interceptors = [TokenInterceptor(config.token)] if config.token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    add_to_server(ReferenceService(state, metrics), server)
    where = f"{config.host}:{config.port}"
    if config.tls_cert:
        bound = server.add_secure_port(where, TlsFiles(config.tls_cert, config.tls_key).credentials())
    else:
        if config.token and config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the token travels in clear text without TLS: pass --tls-cert/--tls-key off this host")
        bound = server.add_insecure_port(where)
    if bound == 0:
        raise OSError(f"could not bind the reference server to {config.host}:{config.port}")
    await server.start()
    return server, bound


async def _expire_forever(state: State) -> None:
    """Leases and agents also expire without traffic, so drains finish."""
    while True:
        await asyncio.sleep(state.config.expiry_period_s)
        state.expire()


async def serve(config: ServerConfig | None = None, *, ready: asyncio.Event | None = None) -> None:
    """Run a reference server until cancelled."""
    state = State(config or ServerConfig())
    host = state.config.host
    metrics = _metrics(state)
    try:
        server, bound = await _start(state, metrics)
    except BaseException:
        metrics.stop()
        raise
    log.info("reference server %s listening on %s:%d", state.instance_id[:8], host, bound)
    guard = ", token required" if state.config.token else ""
    scheme = "TLS" if state.config.tls_cert else "plaintext"
    scrape = f"; metrics on http://{host}:{metrics.port}/metrics" if metrics.port is not None else ""
    print(f"tensorhub reference server listening on {host}:{bound} ({scheme}{guard}; instance "
          f"{state.instance_id[:8]}{scrape})", flush=True)
    if ready is not None:
        ready.set()
    # What the imports made (torch, protobuf, grpc: most of the process's objects)
    # lives as long as the process: frozen, a full collection does not scan it
    # on the event loop, between two RPCs.
    gc.freeze()
    expiry = asyncio.create_task(_expire_forever(state))
    try:
        await server.wait_for_termination()
    finally:
        expiry.cancel()
        await server.stop(grace=0.5)
        metrics.stop()


class EmbeddedServer:
    """A reference server on its own event loop in a daemon thread.

    >>> with EmbeddedServer() as server:
    ...     hub = Hub.connect(server.address)

    ``config`` defaults to ``ServerConfig(port=0)`` (a free port); keyword
    ``overrides`` change fields of it: ``EmbeddedServer(lease_ttl_s=5.0, retain=0)``.
    """

    def __init__(self, config: ServerConfig | None = None, **overrides: Any) -> None:
        config = (config or ServerConfig(port=0)).replace(**overrides)
        self.host = config.host
        self.state = State(config)
        self.metrics = _metrics(self.state)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tensorhub-server", daemon=True)
        self._thread.start()
        self._server, self.port = asyncio.run_coroutine_threadsafe(_start(self.state, self.metrics), self._loop).result(timeout=30)
        self._expiry = asyncio.run_coroutine_threadsafe(_expire_forever(self.state), self._loop)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this server; None without ``metrics_port``."""
        port = self.metrics.port
        return f"http://{self.host}:{port}/metrics" if port is not None else None

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._expiry.cancel()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=0.2), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.metrics.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
