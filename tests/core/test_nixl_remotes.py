"""A remote agent is removed from NIXL only once no READ to it is out.

Found by the fault campaign: a reader died of SIGSEGV inside NIXL after link
cuts. A source lost mid-pull was forgotten (``remove_remote_agent``) while
other READs of the same pull to it were still in flight; polling and releasing
those handles afterwards touched what NIXL had freed. The order of calls is
what matters here, so NIXL's agent is replaced by a recorder (a seam: the crash
itself needed a cut TCP link between two hosts); the bookkeeping is ours."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorhub.transport import MemoryKind
from tensorhub.transport.nixl import NixlAgent, TransferFailed


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.handles = 0

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add", metadata))
        return metadata  # the remote's name, as NIXL would read it from the metadata

    def get_xfer_descs(self, descs: np.ndarray, kind: str) -> np.ndarray:
        return descs

    def initialize_xfer(self, op: str, local: object, remote: object, name: str, notif: bytes = b"") -> int:
        self.handles += 1
        return self.handles

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        return "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        self.calls.append(("release", handle))

    def remove_remote_agent(self, name: str) -> None:
        self.calls.append(("remove", name))


def test_forgetting_a_remote_under_reads_in_flight_waits_for_their_release():
    nixl = NixlAgent("reader-under-test", "read")  # the recorder speaks READ only
    nixl._agent = rec = Recorder()
    descs = np.zeros((1, 3), dtype=np.uint64)
    name = nixl.connect("holder.1", b"holder")
    reads = [nixl.post(name, descs, MemoryKind.DRAM, descs, MemoryKind.DRAM) for _ in range(2)]
    nixl.forget("holder.1")  # one READ failed: the source is lost; the other is still out
    assert not [c for c in rec.calls if c[0] == "remove"]
    nixl.release(reads[0])
    assert not [c for c in rec.calls if c[0] == "remove"]
    nixl.release(reads[1])
    assert rec.calls[-2:] == [("release", 2), ("remove", "holder")]


def test_a_closing_remote_is_not_loaded_again_until_its_reads_end():
    """Loading more metadata of an agent whose removal waits for READs failed
    half-way in NIXL (NIXL_ERR_INVALID_PARAM, and the reader crashed later)."""
    nixl = NixlAgent("reader-under-test-2", "read")
    nixl._agent = rec = Recorder()
    descs = np.zeros((1, 3), dtype=np.uint64)
    name = nixl.connect("holder.1", b"holder")
    read = nixl.post(name, descs, MemoryKind.DRAM, descs, MemoryKind.DRAM)
    nixl.forget("holder.1")
    with pytest.raises(TransferFailed, match="closing"):
        nixl.connect("holder.2", b"holder")  # its next replica, same process
    assert [c for c in rec.calls if c[0] == "add"] == [("add", b"holder")]
    nixl.release(read)
    assert rec.calls[-1] == ("remove", "holder")
    assert nixl.connect("holder.2", b"holder") == "holder"  # loaded afresh
    assert rec.calls[-1] == ("add", b"holder")



class Poisoned(Recorder):
    """NIXL 1.5 after a load failed half-way: every load of the agent fails."""

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add failed", metadata))
        raise RuntimeError("nixlInvalidParamError: NIXL_ERR_INVALID_PARAM")


def test_an_agent_nixl_refuses_to_load_again_is_not_asked_for_again():
    """Found by the fault campaign: after one load failed half-way (a link cut
    as it loaded), every later load of the same live holder failed with
    NIXL_ERR_INVALID_PARAM for minutes, and the reader that kept calling
    into NIXL for it crashed (SIGSEGV). Now the first such refusal is the
    last call for that agent; other agents are untouched."""
    nixl = NixlAgent("reader-under-test-3", "read")
    nixl._agent = rec = Poisoned()
    with pytest.raises(TransferFailed, match="INVALID_PARAM"):
        nixl.connect("holder.1", b"holder")
    with pytest.raises(TransferFailed, match="can no longer load"):
        nixl.connect("holder.2", b"holder")  # its next replica: not asked again
    assert rec.calls == [("add failed", b"holder")]
    nixl._agent = Recorder()
    assert nixl.connect("other.1", b"other") == "other"


class CutWhileLoading(Recorder):
    """NIXL 1.5 when the link to the holder is cut as its metadata loads."""

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add failed", metadata))
        raise RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")


def test_a_load_cut_off_half_way_is_the_last_call_for_that_agent():
    """A load that fails with NIXL_ERR_REMOTE_DISCONNECT leaves the agent
    half-loaded: every retry failed with NIXL_ERR_INVALID_PARAM (157 of 157 in
    three fault campaigns), and two of the five UCX aborts read on 12-01 ("Endpoint
    timeout", the reader killed) came seconds after such a retry. So the first
    failure is the last call into NIXL for that agent."""
    nixl = NixlAgent("reader-under-test-4", "read")
    nixl._agent = rec = CutWhileLoading()
    with pytest.raises(TransferFailed, match="REMOTE_DISCONNECT"):
        nixl.connect("holder.1", b"holder")
    with pytest.raises(TransferFailed, match="can no longer load"):
        nixl.connect("holder.1", b"holder")  # the same replica, asked again by the next round
    assert rec.calls == [("add failed", b"holder")]


class FailsThenForgets(Recorder):
    """A READ whose source disconnected: NIXL says so once; asked again, its
    handle has no request left and reads as done."""

    def __init__(self) -> None:
        super().__init__()
        self.told = False

    def check_xfer_state(self, handle: int) -> str:
        if not self.told:
            self.told = True
            raise RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
        return "DONE"


def test_a_failed_read_stays_failed_at_every_poll():
    """The puller may poll a READ again after a failure (the check-in-cache
    poll right after posting, then its polling loop): a READ that failed must
    never turn into one that finished, or its missing bytes would be taken."""
    nixl = NixlAgent("reader-under-test-4", "read")
    nixl._agent = FailsThenForgets()
    descs = np.zeros((1, 3), dtype=np.uint64)
    read = nixl.post(nixl.connect("holder.1", b"holder"), descs, MemoryKind.DRAM, descs, MemoryKind.DRAM)
    for _ in range(2):
        with pytest.raises(TransferFailed, match="REMOTE_DISCONNECT"):
            nixl.poll(read)
    nixl.release(read)


class Versions(Recorder):
    """Metadata "<agent>#<what>": each replica of one agent brings its own."""

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add", metadata))
        return metadata.split(b"#")[0]


def _regions(*spans: tuple[int, int]) -> np.ndarray:
    return np.array([(addr, nbytes, 0) for addr, nbytes in spans], dtype=np.uint64).reshape(-1, 3)


def test_metadata_of_memory_an_earlier_load_described_loads_the_agent_from_nothing():
    """NIXL adds each load to what it holds of an agent and keeps the
    descriptors of memory the holder has freed since; its lookup then misses
    a newer replica's memory that a stale descriptor starts inside
    (createXferReq: NIXL_ERR_NOT_FOUND, tests/core/test_reused_holder_memory.py).
    A replica whose regions meet an earlier load's is loaded from nothing:
    the agent removed first, its earlier keys loaded again when used. One in
    other memory is added to what NIXL holds, as before (nothing reloaded)."""
    nixl = NixlAgent("reader-under-test-5", "read")
    nixl._agent = rec = Versions()
    assert nixl.connect("holder.1", b"holder#1", _regions((0x1040, 64), (0x20000, 0x10000))) == "holder"
    assert nixl.connect("holder.2", b"holder#2", _regions((0x40000, 0x1000))) == "holder"  # elsewhere
    assert rec.calls == [("add", b"holder#1"), ("add", b"holder#2")]
    assert nixl.connect("holder.3", b"holder#3", _regions((0x20000, 64), (0x1000, 0x10000))) == "holder"
    assert rec.calls[2:] == [("remove", "holder"), ("add", b"holder#3")]
    assert nixl.connect("holder.3", b"holder#3", _regions((0x20000, 64), (0x1000, 0x10000))) == "holder"
    assert nixl.connect("holder.2", b"holder#2", _regions((0x40000, 0x1000))) == "holder"  # dropped with the rest
    assert rec.calls[4:] == [("add", b"holder#2")]  # and loaded beside #3: they do not meet
    # Metadata seen before, of memory it still describes, is known by its digest (no load).
    assert nixl.connect("holder.4", b"holder#2", _regions((0x40000, 0x1000))) == "holder"
    assert len(rec.calls) == 5
    # Without regions, what NIXL holds may describe the same memory: from nothing.
    assert nixl.connect("holder.5", b"holder#5") == "holder"
    assert rec.calls[5:] == [("remove", "holder"), ("add", b"holder#5")]


def test_an_agent_whose_memory_was_reused_is_not_reloaded_under_reads_still_out():
    """Removing an agent under a READ still in flight crashed readers (the first
    test above): a replica that needs its agent loaded from nothing fails
    (another holder serves) until those READs end, then loads."""
    nixl = NixlAgent("reader-under-test-6", "read")
    nixl._agent = rec = Versions()
    descs = np.zeros((1, 3), dtype=np.uint64)
    name = nixl.connect("holder.1", b"holder#1", _regions((0x1000, 0x1000)))
    read = nixl.post(name, descs, MemoryKind.DRAM, descs, MemoryKind.DRAM)
    with pytest.raises(TransferFailed, match="reused"):
        nixl.connect("holder.2", b"holder#2", _regions((0x1800, 0x1000)))
    assert not [c for c in rec.calls if c[0] == "remove"]
    nixl.release(read)
    assert nixl.connect("holder.2", b"holder#2", _regions((0x1800, 0x1000))) == "holder"
    assert rec.calls[-2:] == [("remove", "holder"), ("add", b"holder#2")]


def test_chunk_news_reaches_an_agent_loaded_in_any_form_without_loading_it_again():
    """A relay tells its peers what it landed (client/peernews.py) over the
    connection it has to them: a peer loaded already, from a replica's metadata
    or as a push reader, is notified as it is. Loading the replica's metadata
    for the news would load the agent again from nothing (its regions may meet
    what NIXL holds of it), between the push service's loads, at every chunk."""
    nixl = NixlAgent("relay-under-test", "read")
    nixl._agent = rec = Versions()
    assert nixl.connect("peer.1", b"peer#1", _regions((0x1000, 0x1000))) == "peer"
    assert nixl.reach("peer.2", b"peer#2", _regions((0x1000, 0x1000))) == "peer"  # its next replica, same memory
    assert rec.calls == [("add", b"peer#1")]
    assert nixl.reach("other.1", b"other#1", _regions((0x1000, 0x1000))) == "other"  # not loaded yet: connect
    assert rec.calls[1:] == [("add", b"other#1")]


def test_a_push_holder_writes_into_a_readers_memory_registered_anew_where_it_had_other_memory():
    """Push mode's side of the same NIXL habit, with real NIXL agents in this
    process: a holder loads each requesting reader's whole metadata, and NIXL
    kept the descriptors of the reader's memory that was freed since. A reader
    whose next destination reuses that memory, cut otherwise, had every WRITE
    past the stale descriptor's start refused (createXferReq NIXL_ERR_NOT_FOUND).
    A reader whose whole metadata changed is loaded from nothing (no WRITE out)."""
    from tensorhub.testing import finish_transfer

    holder = NixlAgent("push-holder-under-test", "read")  # write() needs no push service
    reader = NixlAgent("push-reader-under-test", "read")
    try:
        arena = torch.zeros(1 << 20, dtype=torch.uint8)
        source = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)  # 256 KiB of known bytes
        src = holder.register([source])

        def placed(offset: int, nbytes: int) -> torch.Tensor:
            return torch.frombuffer(arena.numpy(), dtype=torch.uint8, count=nbytes, offset=offset)

        def write(at: int, nbytes: int) -> None:
            local = np.array([[source.data_ptr(), nbytes, 0]], dtype=np.uint64)
            remote = np.array([[arena.data_ptr() + at, nbytes, 0]], dtype=np.uint64)
            pending = holder.write(reader.name, reader.local_metadata(), local, MemoryKind.DRAM, remote,
                                   MemoryKind.DRAM, b"")
            finish_transfer(holder, pending)

        small = reader.register([placed(64, 64)])  # the reader's first destination: 64 bytes in
        write(64, 64)
        reader.deregister(small)  # pulled, freed
        big = reader.register([placed(0, 1 << 16)])  # the next one from 0, over the old place
        write(4096, 4096)  # past the stale descriptor's start
        assert torch.equal(arena[4096:8192], source[:4096])
        reader.deregister(big)
        holder.deregister(src)
    finally:
        holder.close()
        reader.close()
