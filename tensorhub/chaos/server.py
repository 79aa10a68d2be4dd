"""The campaign's reference server: ``python -m tensorhub.chaos.server``, a real
server process on its emulated host that also answers, on stdin/stdout, how
many agents, replicas and read leases it holds (the leak check). The driver
SIGKILLs it and starts another on the same port (a server restart: clients
must notice the new instance and register again).

    driver ── "counts\\n" ──▶ stdin │ EmbeddedServer on host:port
           ◀── {"agents": ..} ── stdout
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time


def counts(state) -> dict:  # state: tensorhub.server.state.State
    state.expire()  # what has expired by now is gone, as the next RPC would find it
    replicas = list(state.replicas.values())
    return {"agents": len(state.agents), "replicas": len(replicas), "leases": len(state.leases),
            "retained": sum(r.retained for r in replicas), "instance": state.instance_id[:8]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorhub.chaos.server")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--agent-ttl", type=float, default=5.0)
    parser.add_argument("--lease-ttl", type=float, default=5.0)
    parser.add_argument("--retain", type=int, default=1)
    args = parser.parse_args(argv)
    from tensorhub.server.app import EmbeddedServer
    from tensorhub.server.config import ServerConfig

    config = ServerConfig(host=args.host, port=args.port, agent_ttl_s=args.agent_ttl, lease_ttl_s=args.lease_ttl,
                          retain=args.retain)
    server = EmbeddedServer(config)
    print(f"listening on {server.address}", flush=True)
    for line in sys.stdin:
        if line.strip() == "counts":
            # Read between the event loop's steps: the state is only changed there.
            loop = server._loop
            box: queue.Queue = queue.Queue()
            loop.call_soon_threadsafe(lambda box=box: box.put(counts(server.state)))
            print(json.dumps(box.get(timeout=10)), flush=True)
    server.stop()


class Server:
    """The driver's handle: start without waiting, ``ready()`` to poll, ``counts()``
    with a deadline, ``kill()`` (SIGKILL), ``restart()``."""

    def __init__(self, host: str, port: int, netns: str | None, *, agent_ttl_s: float, lease_ttl_s: float,
                 retain: int = 1) -> None:
        self.address = f"{host}:{port}"
        self._args = [sys.executable, "-m", "tensorhub.chaos.server", "--host", host, "--port", str(port),
                      "--agent-ttl", str(agent_ttl_s), "--lease-ttl", str(lease_ttl_s), "--retain", str(retain)]
        if netns:
            self._args = ["ip", "netns", "exec", netns, *self._args]
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self.is_ready = False
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.is_ready, self._lines = False, queue.Queue()
        self.starts += 1
        lines, out = self._lines, self.proc.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()  # type: ignore[union-attr]

    def ready(self) -> bool:
        while not self.is_ready:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return False
            self.is_ready = line.startswith("listening on")
        return True

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline or (self.proc and self.proc.poll() is not None):
                raise RuntimeError(f"the campaign's reference server did not start on {self.address}")
            time.sleep(0.05)

    def counts(self, timeout: float = 10.0) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("counts\n")
        self.proc.stdin.flush()
        line = self._lines.get(timeout=timeout)
        return json.loads(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.is_ready = False

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


if __name__ == "__main__":
    main()
