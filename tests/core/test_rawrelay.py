"""The raw NIXL rows of ``tensorhub bench cluster`` (``bench.rawrelay``): the
relay's schedule, and real READs between real processes (on this host, no
emulated links: what the rows' bytes and counts must be, not their times)."""

from __future__ import annotations

import pytest

from tensorhub.bench.rawrelay import Place, RawCluster, next_reads


def test_a_reader_keeps_its_own_reads_on_the_trainer_and_fills_the_rest_with_ready_chunks():
    held = {(1, 1), (1, 4), (2, 2)}  # (reader, chunk): what its peers hold

    def has(j: int, c: int) -> bool:
        return (j, c) in held

    needed = list(range(9))  # reader 0 of 3 owns 0, 3, 6
    assert next_reads(0, 3, needed, has, free=4, own_flying=0) == [0, 1, 2, 4]
    assert next_reads(0, 3, needed, has, free=4, own_flying=1) == [1, 2, 4]  # its one own READ is out
    assert next_reads(0, 3, needed, has, free=4, own_flying=0, own=2) == [0, 3, 1, 2]
    assert next_reads(0, 3, needed, has, free=0, own_flying=0) == []
    assert next_reads(0, 3, [5, 7, 8], has, free=4, own_flying=0) == []  # nothing ready: wait
    assert next_reads(1, 3, needed, has, free=2, own_flying=0) == [1, 2]  # 4 it holds itself: never "ready"


@pytest.mark.timeout(180)
def test_raw_rows_move_exact_bytes_and_a_relay_reads_one_copy_from_the_trainer():
    size, chunk = 6 << 20, 256 << 10
    with RawCluster(Place(None), [Place(None)] * 3, size, chunk) as raw:
        single = raw.run("nixl-raw-single", 1)
        every = raw.run("nixl-raw-all")
        relay = raw.run("nixl-raw-relay")
        pair = raw.run("nixl-raw-relay", 2)  # a relay among the first 2: the third stays out
        with pytest.raises(ValueError, match="1 to 3"):
            raw.run("nixl-raw-relay", 4)
        with pytest.raises(ValueError, match="unknown raw method"):
            raw.run("nixl-raw-bogus")
    assert single.ok and every.ok and relay.ok and pair.ok
    assert (single.readers, every.readers, relay.readers, pair.readers) == (1, 3, 3, 2)
    assert single.trainer_bytes == size and every.trainer_bytes == 3 * size
    assert relay.trainer_bytes == size, "a relay read some chunk from the trainer twice"
    assert pair.trainer_bytes == size, "a relay of 2 read some chunk from the trainer twice"
