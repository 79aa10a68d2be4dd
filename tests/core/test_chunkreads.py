"""``client.chunkreads``: a chunk counts once all its READs landed, never pieced
together across a failure; played over generated READ outcomes (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.client.chunkreads import ChunkReads
from tensorhub.client.transfer import Transfer


def _read(source: str, nbytes: int) -> Transfer:
    return Transfer(source, np.zeros((1, 3), np.uint64), np.zeros((1, 3), np.uint64), nbytes)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 9), st.booleans()), min_size=1, max_size=4),
                min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_a_chunk_counts_once_every_read_landed_and_a_failed_one_is_planned_again(plan, rng):
    """Each chunk's READs (source, bytes, fails?) end in a random order; a
    chunk none of whose READs failed is whole when its last lands, with its
    bytes per source; one with a failure never is, and after ``settle`` it is
    read anew as if nothing had happened before."""
    reads = {c: [_read(s, n) for s, n, _ in planned] for c, planned in enumerate(plan)}
    fails = {(c, i) for c, planned in enumerate(plan) for i, (_, _, f) in enumerate(planned) if f}
    book = ChunkReads()
    book.plan(reads)
    ends = [(c, i) for c, planned in reads.items() for i in range(len(planned))]
    rng.shuffle(ends)
    whole: dict[int, tuple[dict[str, int], list[Transfer]]] = {}
    left = {c: len(planned) for c, planned in reads.items()}
    for c, i in ends:
        left[c] -= 1
        if (c, i) in fails:
            book.fail(c)
            continue
        if book.failed(c):
            continue  # landed after another READ of its chunk failed: counts for nothing
        got = book.landed(c, reads[c][i].replica_id, reads[c][i])
        assert (got is not None) == (left[c] == 0), "whole before (or after) its last READ"
        if got is not None:
            whole[c] = got
    for c, planned in reads.items():
        if any((c, i) in fails for i in range(len(planned))):
            assert c not in whole and book.failed(c)
        else:
            by_source: dict[str, int] = {}
            for t in planned:
                by_source[t.replica_id] = by_source.get(t.replica_id, 0) + t.nbytes
            assert whole[c][0] == by_source and sorted(map(id, whole[c][1])) == sorted(map(id, planned))
    book.settle(in_air=set())
    assert not any(book.failed(c) for c in reads)
    book.plan({c: reads[c] for c in reads if c not in whole})  # the failed ones again: none fails now
    for c, planned in reads.items():
        if c not in whole:
            outcomes = [book.landed(c, t.replica_id, t) for t in planned]
            assert all(o is None for o in outcomes[:-1]) and outcomes[-1] is not None


def test_a_failed_chunk_still_in_flight_is_kept_until_its_reads_end():
    book = ChunkReads()
    book.plan({0: [_read("a", 1), _read("b", 1)]})
    book.fail(0)
    book.settle(in_air={0})
    assert book.failed(0)  # its other READ is still out: not planned again yet
    book.settle(in_air=set())
    assert not book.failed(0)


def test_a_chunk_planned_anew_forgets_what_landed_of_it_before():
    book = ChunkReads()
    first = [_read("a", 3), _read("b", 4)]
    book.plan({0: first})
    assert book.landed(0, "a", first[0]) is None
    again = [_read("c", 7)]
    book.plan({0: again})
    assert book.landed(0, "c", again[0]) == ({"c": 7}, again)
