"""What one pull did, counted as it runs (``puller.PullJob``) and read by
``Hub.pull`` into its ``PullResult``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class PullStats:
    """What one pull did: bytes by source, losses, rounds, checks (``Hub.pull``'s ``PullResult`` reads it)."""

    nbytes: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    source_kinds: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name -> (Labels.tier, origin)
    lost_sources: list[str] = field(default_factory=list)
    # Of those, the ones given up on as stalled (slow, no error) that the server
    # still listed alive when no other holder had what was missing: read again.
    sources_read_again: list[str] = field(default_factory=list)
    rounds: int = 0
    verified_bytes: int = 0  # checked against the publisher's chunk checksums
    unverified_bytes: int = 0  # read from a source without checksums, or a holder chunk read in part
    corrupt_sources: list[str] = field(default_factory=list)  # whose bytes failed the check
    # Holder chunks whose bytes failed their check and were read again; of them,
    # those whose bytes came from several holders (nobody excluded: no culprit).
    checks_failed: int = 0
    checks_failed_unplaced: int = 0
    # Every byte of every READ that landed, read again or not: a pull that read
    # nothing twice, nor wide (``wideread``), reads ``nbytes`` (an extra copy of
    # the weights shows here, and so do the rows around a wide read's columns).
    read_bytes: int = 0
    descriptors: int = 0  # of the READs that landed: one per segment, or per wide span
    plans_reused: int = 0  # chunk plans an earlier pull into the same layout made (``plancache``)
    plans_made: int = 0  # chunk plans made by this pull (not in the cache)
    refreshes: int = 0  # resolves this pull sent after its first answer (asking again who holds what)
    news_heard: int = 0  # peers' chunk news that told this pull of chunks it did not know of (``peernews``)
    subscribers: int = 0  # readers that subscribed to this serving pull's news (``peernews``)
    # The longest wave of readers filling the version that a round of it saw, itself included: the next
    # pull, if named, is in that wave again though its answer lists only the holders this one read from
    wave_readers: int = 1
    # Holders a byte was read from, by agent name: whether each came lean (its
    # layout known from an earlier answer: ``replay``)
    lean_sources: dict[str, bool] = field(default_factory=dict)
    # The server's layouts of the holders a byte was read from (``RemoteReplica.wire_layout``):
    # what the next pull into the same buffers names (``server/named.py``)
    read_layouts: dict[bytes, None] = field(default_factory=dict)
    # Per chunk of the read set, the holder (agent name) most of its bytes came
    # from: readers of one version cut alike share chunk numbers, so a relay
    # tree can be traced chunk by chunk (``bench cluster``'s depth).
    chunk_sources: dict[int, str] = field(default_factory=dict)

    def read_from(self, name: str, kind: tuple[int, bool], lean: bool, layout: bytes = b"") -> None:
        """A READ from holder ``name`` landed: its kind (``Labels.tier``, origin), whether it came
        lean, its server layout (b"": none)."""
        self.source_kinds[name] = kind
        self.lean_sources[name] = self.lean_sources.get(name, True) and lean
        if layout:
            self.read_layouts[layout] = None

    def chunk_done(self, chunk: int, sources: dict[str, int]) -> None:
        """Every READ of ``chunk`` landed, ``sources`` giving it these bytes each (agent name -> bytes)."""
        for source, nbytes in sources.items():
            self.bytes_by_source[source] = self.bytes_by_source.get(source, 0) + nbytes
        self.chunk_sources[chunk] = max(sources, key=sources.__getitem__)
