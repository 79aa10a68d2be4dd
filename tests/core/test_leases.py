"""A pull's read-lease bookkeeping (client/leases.py), against a fake lease service.

The puller's tests exercise these paths through whole pulls; here each rule is
pinned on its own: the resolve's lease is used or let go, withdrawn holders are
never counted as covered, what a released lease also covered is leased anew
first, and nothing is left held when the pull ends.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from tensorhub.client.leases import PullLeases
from tensorhub.client.rpc import Resolved
from tensorhub.errors import TensorHubError


class FakeLeaseService:
    def __init__(self, *, withdrawn: set[str] | None = None, ttl_s: float = 10.0) -> None:
        self.withdrawn = withdrawn or set()
        self.ttl_s = ttl_s
        self.granted: dict[str, set[str]] = {}
        self.released: list[str] = []
        self.unrenewable: set[str] = set()

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]:
        lease_id = f"L{len(self.granted) + 1}"
        granted = [rid for rid in replica_ids if rid not in self.withdrawn]
        self.granted[lease_id] = set(granted)
        return lease_id, granted, self.ttl_s

    def renew_lease(self, agent_id: str, lease_id: str) -> float:
        if lease_id in self.unrenewable:
            raise TensorHubError(f"lease {lease_id} is gone")
        return self.ttl_s

    def release_lease_async(self, agent_id: str, lease_id: str) -> None:
        self.released.append(lease_id)


def _resolved(*replica_ids: str, lease_id: str = "R") -> Resolved:
    replicas = tuple(SimpleNamespace(source=SimpleNamespace(replica_id=rid)) for rid in replica_ids)
    return Resolved(model="m", version=1, manifest=None, replicas=replicas,  # type: ignore[arg-type]
                    lease_id=lease_id, lease_ttl_s=10.0, lease_sent_at=time.monotonic())


def test_the_resolves_lease_covers_every_holder_it_listed_without_asking_again():
    service = FakeLeaseService()
    leases = PullLeases(service, "reader")
    leases.upfront = _resolved("a.0", "b.0", "c.0")
    assert leases.upfront_covers(["a.0", "b.0"])
    assert leases.take(["a.0", "b.0"]) == {"a.0", "b.0", "c.0"}
    assert service.granted == {}  # no AcquireReadLease: the resolve's lease is used
    assert leases.upfront is None and all(leases.covers(r) for r in ("a.0", "b.0", "c.0"))


def test_a_resolves_lease_that_misses_a_rounds_holder_is_let_go():
    service = FakeLeaseService()
    leases = PullLeases(service, "reader")
    leases.upfront = _resolved("a.0", lease_id="R")
    assert not leases.upfront_covers(["a.0", "late-peer.0"])
    leases.drop_upfront()
    assert service.released == ["R"] and leases.upfront is None
    assert leases.take(["a.0", "late-peer.0"]) == {"a.0", "late-peer.0"}
    assert service.granted == {"L1": {"a.0", "late-peer.0"}}


def test_a_withdrawn_holder_is_never_counted_as_covered():
    leases = PullLeases(FakeLeaseService(withdrawn={"b.0"}), "reader")
    assert leases.take(["a.0", "b.0"]) == {"a.0"}
    assert leases.covers("a.0") and not leases.covers("b.0")


def test_releasing_a_gone_holder_leases_what_else_it_covered_first():
    service = FakeLeaseService()
    leases = PullLeases(service, "reader")
    leases.take(["trainer.0", "peer.0"])  # L1 covers both
    assert leases.take_over(["rollout.0"])  # L2: the complete holder that takes over
    leases.release({"trainer.0"}, listed={"peer.0", "rollout.0"})
    assert service.released == ["L1"]
    assert service.granted["L3"] == {"peer.0"}  # leased anew before L1 went
    assert leases.covering("peer.0").lease_id == "L3"
    assert leases.covers("rollout.0") and not leases.covers("trainer.0")


def test_take_over_says_when_a_complete_holder_was_withdrawn_meanwhile():
    leases = PullLeases(FakeLeaseService(withdrawn={"rollout.0"}), "reader")
    assert not leases.take_over(["rollout.0"])
    assert not leases.covers("rollout.0")


def test_still_leased_is_false_for_a_lease_that_ran_out_and_could_not_be_renewed():
    service = FakeLeaseService(ttl_s=0.05)
    leases = PullLeases(service, "reader")
    leases.take(["a.0"])
    assert leases.still_leased("a.0")  # renewed: TTL half gone at once
    service.unrenewable.add("L1")
    time.sleep(0.1)
    assert not leases.still_leased("a.0")
    assert not leases.still_leased("never-leased.0")
    leases.forget("a.0")
    assert not leases.covers("a.0")


def test_release_all_lets_every_lease_go_including_an_unused_resolve_lease():
    service = FakeLeaseService()
    leases = PullLeases(service, "reader")
    leases.take(["a.0"])
    leases.take(["b.0"])
    leases.upfront = _resolved("c.0", lease_id="R")
    leases.release_all()
    assert sorted(service.released) == ["L1", "L2", "R"]
    assert not any(leases.covers(r) for r in ("a.0", "b.0", "c.0")) and leases.upfront is None
