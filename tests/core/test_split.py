"""``readlayout.split``: a checked pull's READs cut into pieces, against a
byte-by-byte reference (hypothesis draws the descriptors and the piece size)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.client.readlayout import split
from tensorhub.client.transfer import Transfer


def _bytes(t: Transfer) -> list[tuple[int, int, int, int, int]]:
    """Every byte the transfer moves, in its order: (local addr, remote addr,
    holder offset, local device, remote device)."""
    out = []
    for i, ((la, n, ld), (ra, rn, rd)) in enumerate(zip(t.local.tolist(), t.remote.tolist())):
        assert n == rn
        h = int(t.h_off[i]) if t.h_off is not None else -1
        out += [(la + k, ra + k, h + k if h >= 0 else -1, ld, rd) for k in range(n)]
    return out


@st.composite
def transfers(draw) -> Transfer:
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda xs: sum(xs) > 0))
    local_at, remote_at, h_at = draw(st.integers(0, 1 << 20)), draw(st.integers(0, 1 << 20)), draw(st.integers(0, 999))
    local, remote, h_off = [], [], []
    for n in lengths:  # descriptors need not be adjacent on either side
        local.append((local_at, n, draw(st.integers(0, 1))))
        remote.append((remote_at, n, 0))
        h_off.append(h_at)
        local_at += n + draw(st.integers(0, 5))
        remote_at += n + draw(st.integers(0, 5))
        h_at += n + draw(st.integers(0, 5))
    with_h = draw(st.booleans())
    return Transfer("r", np.array(local, np.uint64), np.array(remote, np.uint64), sum(lengths),
                    np.array(h_off, np.int64) if with_h else None)


@settings(max_examples=300, deadline=None)
@given(transfers(), st.integers(1, 64))
def test_split_moves_the_same_bytes_in_pieces_cut_at_multiples(t: Transfer, max_bytes: int) -> None:
    pieces = split(t, max_bytes)
    assert [b for p in pieces for b in _bytes(p)] == _bytes(t)  # the same bytes, in order
    if t.nbytes <= max_bytes:
        assert pieces == [t]
        return
    assert [p.nbytes for p in pieces] == [min(max_bytes, t.nbytes - at) for at in range(0, t.nbytes, max_bytes)]
    for p in pieces:
        assert p.nbytes == int(p.local[:, 1].sum()) == int(p.remote[:, 1].sum())
        assert p.local.dtype == p.remote.dtype == np.uint64
        assert (p.h_off is None) == (t.h_off is None)
        assert (p.local[:, 1] > 0).all()  # no empty descriptor goes to NIXL
