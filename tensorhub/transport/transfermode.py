"""Which NIXL operation moves a pull's bytes: READ (the reader pulls) or push
(the holder WRITEs what the reader asks for, see tensorhub.transport.push).

Why push exists: UCX's TCP transport has no native GET, so over TCP every READ
is emulated, and the serving process's UCX answers it with active messages
whose send error (the reader died mid-READ) is fatal to the *serving* process
(``ucs_fatal`` in UCX's rma_sw.c; measured: 9 of 52 serving peers died when
their reader was killed mid-READ). PUT is native over TCP, and a peer's death
during a WRITE leaves the survivor alive (54 of 54). Where push is used the UCX
backend is created with emulation disabled, so no emulated READ (or WRITE) can
run silently: it fails at once instead.

Setting: ``HubConfig.transfer`` or ``$TENSORHUB_TRANSFER``: "read", "push" or
"auto" (the default): push when this process's UCX can reach other processes
only over TCP (``UCX_TLS`` names tcp and neither a shared-memory nor an RDMA
transport), READ otherwise.

The choice is per peer: a push holder says so in the metadata it publishes
(``advertise``), and a push reader asks only such holders to WRITE; from the
others (a process on transfer=read, or an older TensorHub) it READs. Where that
READ would be emulated (over TCP), this reader's UCX refuses it at once, and
the pull fails over with an error that says why, not after a silence.
"""

from __future__ import annotations

import os

TRANSFER_ENV = "TENSORHUB_TRANSFER"
MODES = ("read", "push", "auto")

# UCX transport names (UCX_TLS) that give a native GET, or keep GET off TCP:
# shared memory within a host, RDMA between hosts. "all" may pick any of them.
_NATIVE_GET_TLS = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "rc", "rc_v", "rc_x", "rc_mlx5",
                   "dc", "dc_x", "dc_mlx5", "ud", "ud_v", "ud_x", "ud_mlx5", "ib", "all", "cuda_ipc", "gdr_copy")

# Passed to the UCX backend where push is used: an emulated operation (a READ
# over TCP) becomes an immediate error ("No zero-copy protocol found") instead
# of the path that can abort the serving process.
PUSH_ENGINE_CONFIG = "PROTO_EMULATION_ENABLE=n"

# Prefixed to the NIXL metadata a push holder publishes (a replica's
# nixl_metadata): "I serve push requests". NIXL's own metadata starts with
# "nixlSerDes", so metadata without the prefix is a holder that serves none.
PUSH_ADVERT = b"THP1"


def tcp_only(env: dict[str, str] | None = None) -> bool:
    """Whether UCX_TLS limits UCX to TCP between processes (every READ emulated)."""
    env = os.environ if env is None else env
    tls = env.get("UCX_TLS", "").strip().lower()
    if not tls or tls.startswith("^"):  # unset or an exclusion list: UCX picks shared memory or RDMA where present
        return False
    names = {name.strip() for name in tls.split(",")}
    return "tcp" in names and not names & set(_NATIVE_GET_TLS)


def resolve_transfer(setting: str = "", env: dict[str, str] | None = None) -> str:
    """"read" or "push" for ``setting`` (empty: $TENSORHUB_TRANSFER, else "auto")."""
    env = os.environ if env is None else env
    mode = (setting or env.get(TRANSFER_ENV, "") or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"transfer mode {mode!r} is not one of {', '.join(MODES)} "
                         f"(HubConfig.transfer or ${TRANSFER_ENV})")
    if mode == "auto":
        return "push" if tcp_only(env) else "read"
    return mode


def advertise(metadata: bytes, serves_push: bool) -> bytes:
    """The metadata a holder publishes: NIXL's, marked where it serves push requests."""
    return PUSH_ADVERT + metadata if serves_push else metadata


def advertised(published: bytes) -> tuple[bytes, bool]:
    """(NIXL's metadata, whether the holder serves push requests) of published metadata."""
    if published.startswith(PUSH_ADVERT):
        return published[len(PUSH_ADVERT):], True
    return published, False
