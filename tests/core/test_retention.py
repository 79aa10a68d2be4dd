"""Retention (contract 5): the latest K versions stay pullable after their last
reliable holder unpublishes; the copy lives in the holder's host memory until
a newer version makes it unnecessary. Spot replicas never count."""

from __future__ import annotations

import time

import pytest

from tensorhub.testing import HubProcess, RemoteError, mixed_specs

SPECS = mixed_specs(16, largest_bytes=1 << 20)


def _wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_latest_version_survives_unpublish_and_overwrite(retaining_server):
    address = retaining_server.address
    with HubProcess(address, name="trainer", heartbeat_interval_s=0.2) as trainer, \
            HubProcess(address, name="reader") as reader:
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1)
        trainer.call("unpublish", model="m", version=1)
        trainer.call("overwrite", model="m", version=1, seed=99)  # the optimizer step, in place
        got = reader.call("pull", model="m", specs=SPECS, expect_seed=1)
        assert got["version"] == 1 and got["mismatched"] == [], "the retained copy must hold the old bytes"
        # A newer version makes the retained copy unnecessary: it is released.
        trainer.call("publish", model="m", version=2, specs=SPECS, seed=2)
        _wait_for(lambda: reader.call("versions", model="m") == [2])
        with pytest.raises(RemoteError) as err:
            reader.call("pull", model="m", version=1, specs=SPECS)
        assert err.value.type_name == "VersionNotFound"


def test_no_copy_while_another_reliable_replica_holds_the_version(retaining_server):
    address = retaining_server.address
    with HubProcess(address, name="trainer") as trainer, HubProcess(address, name="rollout") as rollout, \
            HubProcess(address, name="reader") as reader:
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1)
        rollout.call("pull", model="m", specs=SPECS, serve=True)
        trainer.call("unpublish", model="m", version=1)
        got = reader.call("pull", model="m", specs=SPECS, expect_seed=1)
        assert got["mismatched"] == [] and got["sources"] == {"rollout": got["nbytes"]}


def test_spot_replicas_do_not_count_as_the_retained_copy(retaining_server):
    address = retaining_server.address
    with HubProcess(address, name="trainer") as trainer, \
            HubProcess(address, name="spot", reliability="spot") as spot, \
            HubProcess(address, name="reader") as reader:
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1)
        spot.call("pull", model="m", specs=SPECS, serve=True)
        trainer.call("unpublish", model="m", version=1)  # the spot copy is not enough: the trainer retains
        trainer.call("overwrite", model="m", version=1, seed=99)
        spot.call("unpublish", model="m", version=1)  # a spot holder leaving never blocks on retention
        got = reader.call("pull", model="m", specs=SPECS, expect_seed=1)
        assert got["mismatched"] == [] and set(got["sources"]) == {"trainer"}
