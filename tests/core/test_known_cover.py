"""A trainer's shards republished from the same tables (the steady state):
the server notes them and makes the version visible once the set that covered
the version before is back, instead of adding each holder's regions group by
group (``coverage.KnownCover``, ``State._noted``). Visibility, the missing
regions and the fallbacks must read exactly as the full computation."""

from __future__ import annotations

import pytest

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.regions import Region
from tensorhub.server import coverage
from tensorhub.server.state import State, StateError, check_held
from tensorhub.topology import Labels, Reliability

RANKS, ROWS, COLS = 4, 8, 6
MANIFEST = Manifest(tensors=tuple(TensorSpec(name=f"t{i}", dtype="float32", shape=(ROWS, COLS), nbytes=ROWS * COLS * 4)
                                  for i in range(3)))


def _rows(lo: int, hi: int):
    return check_held(MANIFEST, [(t, Region(box=((lo, hi), (0, COLS)))) for t in range(len(MANIFEST.tensors))])


SHARDS = [_rows(r * ROWS // RANKS, (r + 1) * ROWS // RANKS) for r in range(RANKS)]  # kept: a rank's same table


@pytest.fixture
def state() -> State:
    s = State()
    for r in range(RANKS):
        s.register_agent(f"rank{r}", f"rank{r}", Labels(), Reliability.RELIABLE)
    s.register_agent("other", "other", Labels(), Reliability.RELIABLE)
    return s


def _publish(state: State, rank: int, version: int, table=None, replica: str = "", agent: str = "") -> None:
    state.publish(agent_id=agent or f"rank{rank}", replica_id=replica or f"rank{rank}.{version}", model="m",
                  version=version, manifest=MANIFEST, held=table if table is not None else SHARDS[rank],
                  chunk_size=1 << 20, memory=None, complete=True, bitmap=b"", origin=True)


@pytest.fixture
def adds(monkeypatch) -> list[int]:
    """Coverage.add calls, counted (one per holder added the long way)."""
    calls: list[int] = []
    real = coverage.Coverage.add

    def counted(self, keys):
        calls.append(1)
        return real(self, keys)

    monkeypatch.setattr(coverage.Coverage, "add", counted)
    return calls


def test_the_shards_republished_make_the_next_version_visible_as_the_last_is_back(state, adds):
    for r in range(RANKS):
        _publish(state, r, 1)
    assert state.models["m"][1].visible and len(adds) == RANKS  # the first version the long way
    adds.clear()
    for r in range(RANKS - 1):
        _publish(state, r, 2)
        assert not state.models["m"][2].visible and state.latest_visible("m") == 1
    _publish(state, RANKS - 1, 2)
    assert state.models["m"][2].visible and state.latest_visible("m") == 2
    assert not adds  # noted, not added
    assert state.worked_out(state.models["m"][2]).missing() == ([], 0)


def test_what_a_version_lacks_while_its_shards_are_noted(state):
    for r in range(RANKS):
        _publish(state, r, 1)
    for r in range(RANKS - 1):
        _publish(state, r, 2)
    missing, count = state.worked_out(state.models["m"][2]).missing()  # the noted shards count
    assert count == len(MANIFEST.tensors) and {box for _, box in missing} == {((6, 8), (0, 6))}
    with pytest.raises(StateError, match=r"not complete: no complete holder has t0 rows 6:8"):
        state.resolve("m", 2)
    _publish(state, RANKS - 1, 2)  # worked out in full once asked: the last one goes the long way
    assert state.models["m"][2].visible


def test_a_noted_shard_withdrawn_before_the_set_is_back_keeps_the_version_hidden(state):
    for r in range(RANKS):
        _publish(state, r, 1)
    for r in range(RANKS - 1):
        _publish(state, r, 2)
    state.withdraw("rank0", "rank0.2")
    _publish(state, RANKS - 1, 2)
    entry = state.models["m"][2]
    assert not entry.visible  # rank 0's rows are nobody's
    assert {box for _, box in state.worked_out(entry).missing()[0]} == {((0, 2), (0, 6))}
    _publish(state, 0, 2, replica="rank0.2b")
    assert entry.visible


def test_a_shard_whose_agent_expired_is_not_counted(state):
    for r in range(RANKS):
        _publish(state, r, 1)
    for r in range(RANKS - 1):
        _publish(state, r, 2)
    state.agents["rank1"].expires_at = 0.0  # its heartbeats stopped
    state._next_expiry = 0.0
    state.expire()
    _publish(state, RANKS - 1, 2)
    assert not state.models["m"][2].visible
    assert {box for _, box in state.worked_out(state.models["m"][2]).missing()[0]} == {((2, 4), (0, 6))}


def test_other_regions_are_added_the_long_way_with_the_noted_ones(state, adds):
    for r in range(RANKS):
        _publish(state, r, 1)
    for r in range(RANKS - 1):
        _publish(state, r, 2)
    adds.clear()
    _publish(state, 0, 2, table=_rows(6, 7), replica="other.2", agent="other")  # half of the last rank's rows
    entry = state.models["m"][2]
    assert adds and not entry.visible
    assert {box for _, box in state.worked_out(entry).missing()[0]} == {((7, 8), (0, 6))}
    _publish(state, RANKS - 1, 2)  # the set is complete again: noted or added, the version shows
    assert entry.visible


def test_a_republish_under_the_same_replica_id_is_worked_out_in_full(state):
    for r in range(RANKS):
        _publish(state, r, 1)
    for r in range(RANKS):
        _publish(state, r, 2)
    assert state.models["m"][2].visible
    _publish(state, 0, 3)
    _publish(state, 0, 3, table=_rows(0, 1))  # replaced by a smaller one: rows 1-2 of rank 0's are gone
    for r in range(1, RANKS):
        _publish(state, r, 3)
    entry = state.models["m"][3]
    assert not entry.visible
    assert {box for _, box in state.worked_out(entry).missing()[0]} == {((1, 2), (0, 6))}
