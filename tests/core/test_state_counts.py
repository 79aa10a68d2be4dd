"""A version's relays and filling replicas, kept as counts (every Resolve's
pace asks them) rather than counted over every replica: after any sequence of
publishes, replacements, chunk reports, withdrawals, losses and removals they
equal a count over the replicas."""

from __future__ import annotations

import random

import pytest

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.server.state import State, StateError
from tensorhub.topology import Labels, Reliability

MANIFEST = Manifest(tensors=(TensorSpec(name="t", dtype="float32", shape=(4, 4), nbytes=64),))
AGENTS = [f"a{i}" for i in range(5)]


def _recount(state: State) -> dict[tuple[str, int], tuple[int, int]]:
    return {(model, v): (sum(1 for r in e.replicas.values() if not r.complete and not r.withdrawn and not r.lost),
                         sum(1 for r in e.replicas.values() if not r.origin and not r.withdrawn and not r.lost))
            for model, versions in state.models.items() for v, e in versions.items()}


def _kept(state: State) -> dict[tuple[str, int], tuple[int, int]]:
    return {(model, v): (e.filling_relays(), e.relays())
            for model, versions in state.models.items() for v, e in versions.items()}


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_counts_equal_a_recount_after_any_changes(seed):
    rng = random.Random(seed)
    state = State()
    for a in [*AGENTS, "reader"]:
        state.register_agent(a, a, Labels(), Reliability.RELIABLE)
    leases: list[str] = []
    seen = set()
    for step in range(300):
        agent, version = rng.choice(AGENTS), rng.randint(1, 3)
        replica_id = f"{agent}.{version}.{rng.randint(0, 1)}"
        op = rng.choice(["publish", "publish", "report", "withdraw", "lost", "remove", "lease", "release"])
        try:
            if op == "publish":
                state.publish(agent_id=agent, replica_id=replica_id, model="m", version=version, manifest=MANIFEST,
                              held=[], chunk_size=16, memory=None, complete=rng.random() < 0.4, bitmap=b"",
                              origin=rng.random() < 0.3)
            elif op == "report":
                state.report_chunks(agent, replica_id, [0, 1, 2, 3], complete=True)
            elif op == "withdraw":
                state.withdraw(agent, replica_id)
            elif op == "lost":
                state.report_lost(replica_id)
            elif op == "remove":
                state.remove_replica(replica_id)
            elif op == "lease" and replica_id in state.replicas:
                leases.append(state.acquire_lease("reader", [replica_id]).lease_id)
            elif op == "release" and leases:
                state.release_lease(leases.pop(rng.randrange(len(leases))))
        except StateError:
            pass  # refused (another live replica of the agent, not its own, ...): nothing changed
        assert _kept(state) == _recount(state), (step, op)
        seen |= {(op, filling > 0, relays > 0) for filling, relays in _kept(state).values()}
    assert {("lost", True, True), ("withdraw", True, True), ("report", True, True)} <= seen  # it tried something
