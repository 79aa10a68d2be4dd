"""Settings of a Hub client. Plain values, so recipes can build them from dicts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from tensorhub.chunks import DEFAULT_CHUNK_SIZE
from tensorhub.topology import Labels, Reliability

TOKEN_ENV = "TENSORHUB_TOKEN"


@dataclass(kw_only=True, slots=True)
class HubConfig:
    name: str = ""  # shown in messages and plans; default host:pid
    labels: Labels = field(default_factory=Labels.local)
    reliability: Reliability = Reliability.RELIABLE
    chunk_size: int = DEFAULT_CHUNK_SIZE  # bytes per chunk of the versions this hub publishes
    # Readers of a zone that read across the zone's boundary while others of the
    # zone fill the same version; the rest read from them (every reader must agree).
    seeds_per_zone: int = 1
    read_workers: int = 2  # READs in flight per pull: twice this (one thread posts and polls them)
    chunk_timeout_s: float = 10.0  # a chunk read making no progress this long = source lost
    pull_timeout_s: float = 600.0  # a whole pull, failovers included
    # Publishers compute a CRC-32 of every chunk once (tensorhub.integrity) and
    # readers check each chunk they read against it, failing over from a source
    # whose bytes do not match. Off: publish sends none and pulls check nothing.
    verify_chunks: bool = True
    # How a pull weighs reading a holder's exact element runs (a descriptor each)
    # against a wider contiguous span cut locally (tensorhub.transport.cost):
    # "auto" (shared memory within a host, TCP between hosts), a backend's name
    # ("shm", "tcp", "rdma", "nvlink"), or "exact": never read more than asked.
    read_cost: str = "auto"
    # Pulls given ``have=`` (the destination holds that earlier version): "auto"
    # patches it from the version's deltas where its holders published them
    # (tensorhub.client.delta), "off" always reads the version whole.
    delta: str = "auto"
    # Hub.publish(cut="readers"): the most bytes of full tensors (and staging)
    # a trainer rank holds at once while gathering its share of the readers'
    # cut (tensorhub.client.trainercut); a tensor bigger than this alone is an
    # error. Its share of the cut itself comes on top, for as long as it publishes.
    cut_gather_bytes: int = 1 << 30
    # How bytes move: "read" (NIXL READ), "push" (the holder WRITEs what the
    # reader asks for) or "auto": push where UCX would emulate READ (TCP only),
    # whose failure can abort the serving process (tensorhub.transport.transfermode).
    # Empty: $TENSORHUB_TRANSFER, else auto. Every process must resolve the same.
    transfer: str = ""
    # A serving pull tells the filling peers it knows which chunks it landed
    # (NIXL notifications, tensorhub.client.peernews), and a pull that hears its
    # peers asks the server who holds what less often. Off: only the server says.
    chunk_news: bool = True
    # The steady state: a pull names the holders (by layout) its previous pull
    # of the model read from, and the server answers with their replicas of the
    # version alone, without ranking every holder (``server/named.py``),
    # waiting up to this long for one not published yet (an upstream relay
    # whose own pull is starting). 0: no wait (a holder missing: ranked as
    # usual); negative: never name holders.
    named_wait_s: float = 1.0
    # The steady state: a member of an engine's group sends the announce of the
    # replica its pull is about to fill with the engine's Resolve (one message a
    # step fewer, no announces' round before the first READ: tensorhub.client.ahead).
    announce_ahead: bool = True
    rpc_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    connect_timeout_s: float = 10.0  # Hub.connect fails after this if the server is unreachable
    # The server's shared token (`tensorhub server --token-file`); empty: $TENSORHUB_TOKEN, if set.
    token: str = field(default="", repr=False)
    # PEM file of the CA (or self-signed certificate) the server's TLS certificate
    # is checked against; set: the channel uses TLS. Empty: plaintext.
    tls_root_cert: str = ""
    tls_server_name: str = ""  # the name the certificate must carry, when not the address's host

    def resolved_token(self) -> str:
        """The token to send: this config's, else $TENSORHUB_TOKEN, else none."""
        return self.token or os.environ.get(TOKEN_ENV, "").strip()

    @classmethod
    def from_dict(cls, values: dict) -> HubConfig:
        """Build from plain values (e.g. a Hydra node); unknown keys are an error."""
        return cls(**cls.coerce(values))

    @classmethod
    def coerce(cls, values: dict) -> dict:
        """Check field names and turn plain values (strings, dicts) into field types."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"HubConfig has no field(s) {sorted(unknown)}; known: {sorted(known)}")
        values = dict(values)
        if "labels" in values:
            values["labels"] = Labels.parse(values["labels"])
        if "reliability" in values and not isinstance(values["reliability"], Reliability):
            try:
                values["reliability"] = Reliability(values["reliability"])
            except ValueError:
                raise ValueError(f"HubConfig.reliability must be 'reliable' or 'spot', not {values['reliability']!r}") from None
        return values
