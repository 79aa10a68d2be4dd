"""Ports for processes on this machine: a free port for a server, and a
torch.distributed rendezvous that needs none."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port that range
    hands out (``bind`` to port 0) is the kind the kernel also gives every
    outgoing connection, and on a machine busy with gRPC, UCX and Ray traffic
    one of them can take it before the caller binds it. Another process may
    still choose the same port: for a torch.distributed rendezvous use
    ``rendezvous``, which leaves no gap at all."""
    low = _ephemeral_ports_start()
    for _ in range(200):
        port = random.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or lingering from a closed connection
            return port
    with socket.socket() as s:  # every try was taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@contextlib.contextmanager
def rendezvous(world_size: int) -> Iterator[dict[str, str]]:
    """A torch.distributed rendezvous (``env://``) for ranks in child processes,
    held by this process: a TCPStore bound to a port the OS picks, so no port is
    free one moment and taken the next. (Rank 0 binding a ``free_port`` itself
    failed a CI run with EADDRINUSE, and the other ranks waited for it.)

    Yields the variables to set in every rank's environment, beside RANK and
    WORLD_SIZE: with TORCHELASTIC_USE_AGENT_STORE every rank, rank 0 too, is a
    client of this store, as under torchrun. The store lives until the block ends."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store
