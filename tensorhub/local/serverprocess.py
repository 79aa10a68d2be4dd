"""``tensorhub server`` as a subprocess on a fixed port."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING

from tensorhub.local.ports import free_port

if TYPE_CHECKING:
    from typing_extensions import Self


class ServerProcess:
    """``tensorhub server`` as a subprocess on a fixed port, so that it can be
    killed and started again at the same address."""

    def __init__(self, port: int | None = None, *, agent_ttl_s: float = 10.0, lease_ttl_s: float = 10.0,
                 host: str = "127.0.0.1", netns: str | None = None, retain: int = 1) -> None:
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self._args = [sys.executable, "-m", "tensorhub.cli", "server", "--host", host, "--port", str(self.port),
                      "--agent-ttl", str(agent_ttl_s), "--lease-ttl", str(lease_ttl_s), "--retain", str(retain)]
        if netns:
            self._args = ["ip", "netns", "exec", netns, *self._args]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening on" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"tensorhub server did not start on {self.address}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
