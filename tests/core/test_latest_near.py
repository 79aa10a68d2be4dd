"""``Hub.latest_near``: the newest version a complete replica in the caller's
zone holds. A rollout across a slow link moves to it instead of ``latest``, so
it keeps generating while the next version crosses to its zone's seed (found by
``tensorhub bench rl scenario=crossdc``: every rollout that asked for ``latest``
waited for the version to cross, and several versions crossed at once)."""

from __future__ import annotations

import pytest

from tensorhub.testing import HubProcess, RemoteError, mixed_specs

SPECS = mixed_specs(8, largest_bytes=256 << 10)


def test_latest_near_is_the_newest_version_held_complete_in_the_zone(server):
    address = server.address
    with HubProcess(address, name="trainer", labels={"host": "t", "zone": "a"}) as trainer, \
            HubProcess(address, name="seed", labels={"host": "s", "zone": "b"}) as seed, \
            HubProcess(address, name="rollout", labels={"host": "r", "zone": "b"}) as rollout, \
            HubProcess(address, name="elsewhere", labels={"host": "e", "zone": "c"}) as elsewhere:
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1)
        with pytest.raises(RemoteError) as err:  # nothing in zone b yet
            rollout.call("latest_near", model="m")
        assert err.value.type_name == "VersionNotFound"
        seed.call("pull", model="m", version=1, specs=SPECS, serve=True)
        trainer.call("publish", model="m", version=2, specs=SPECS, seed=2)
        assert rollout.call("latest", model="m") == 2
        assert rollout.call("latest_near", model="m") == 1  # 2 has not crossed to zone b
        seed.call("pull", model="m", version=2, specs=SPECS, serve=True)
        assert rollout.call("latest_near", model="m") == 2
        with pytest.raises(RemoteError):
            elsewhere.call("latest_near", model="m")
