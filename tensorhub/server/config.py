"""Settings of the reference server. Plain values, so recipes and the command
line build them the same way."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from tensorhub.server.auth import check_token


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    # Access control (docs/operations/index.md, "Token and TLS"): every RPC must carry this shared token;
    # empty: none needed. TLS when both PEM paths are set (certificate chain, key).
    token: str = field(default="", repr=False)
    tls_cert: str = ""
    tls_key: str = ""
    agent_ttl_s: float = 10.0  # an agent without a heartbeat this long is gone, with its replicas
    lease_ttl_s: float = 10.0  # a read lease without renewal this long is released
    # A reader's stall report (no READ landed, no word, no error) hides the holder from every reader only if
    # its agent has not heartbeated for this long: one that did is alive and only slow to that reader
    # (16 readers of one trainer over one 100 Mbit/s link starve each other's flows for seconds, the holder's
    # heartbeats queue behind them too). Half the agent's TTL: a dead holder is hidden by the next report after.
    stall_alive_s: float = 5.0
    retain: int = 1  # the latest K visible versions of each model stay pullable; 0: no retention
    max_message_bytes: int = 16 << 20  # gRPC messages in either direction
    expiry_period_s: float = 0.5  # leases and agents also expire without traffic
    max_wait_s: float = 60.0  # longest WaitForVersion long poll; a longer timeout_s is cut to this
    max_sources: int = 16  # holders a Resolve returns at most (the reader's k best, plus any needed for coverage)
    # Prometheus metrics over HTTP on host:metrics_port (server/metrics.py); None: off, 0: a free port.
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port {self.port} outside [0, 65535]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"ServerConfig.metrics_port {self.metrics_port} outside [0, 65535]")
        if self.token:
            check_token(self.token, "ServerConfig.token")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("ServerConfig.tls_cert and tls_key go together: give both PEM files, or neither")
        for name in ("agent_ttl_s", "lease_ttl_s", "stall_alive_s", "expiry_period_s", "max_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerConfig.{name} must be a positive number of seconds, not {value!r}")
        if self.max_sources < 1:
            raise ValueError(f"ServerConfig.max_sources must be >= 1, not {self.max_sources}")
        if self.retain < 0:
            raise ValueError(f"ServerConfig.retain must be >= 0, not {self.retain}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(f"ServerConfig.max_message_bytes {self.max_message_bytes} is under 1 MiB")

    def replace(self, **overrides: Any) -> ServerConfig:
        """A copy with some fields changed; an unknown name is a ValueError."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"ServerConfig has no field(s) {sorted(unknown)}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)
