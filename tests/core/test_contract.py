"""The mutability contract and failures: unpublish drains readers, a dead
holder is a SourceLost within seconds, a restarted server is re-populated."""

from __future__ import annotations

import contextlib
import time

import pytest

from tensorhub.testing import HubProcess, RemoteError, ServerProcess, mixed_specs, wait_for_progress

BIG = [("w", "float32", ((32 << 20) // 4,))]  # 32 MiB: 32 chunks of 1 MiB
CHUNK = 1 << 20


def test_unpublish_blocks_while_a_read_is_in_flight(hubs, tmp_path):
    trainer, reader = hubs("trainer"), hubs("reader", read_workers=1)
    trainer.call("publish", model="m", version=1, specs=BIG, seed=1, chunk_size=CHUNK)
    # The reader's progress callback sleeps after every chunk: the pull takes ~1.6 s.
    marks = str(tmp_path / "progress")
    reader.send("pull", model="m", version=1, specs=BIG, expect_seed=1, pace_s=0.05, progress_file=marks)
    wait_for_progress(marks)
    unpublished = trainer.call("unpublish", model="m", version=1, timeout=30)
    pulled = reader.result()
    assert pulled["mismatched"] == []
    assert unpublished["end"] >= pulled["end"] - 0.05, "unpublish returned while the read was in flight"
    assert unpublished["end"] - unpublished["start"] > 0.3
    with pytest.raises(RemoteError) as err:
        reader.call("pull", model="m", version=1, specs=BIG)
    assert err.value.type_name == "VersionNotFound"


def test_unpublish_with_no_reader_returns_at_once(hubs):
    trainer = hubs("trainer")
    trainer.call("publish", model="m", version=1, specs=BIG, seed=1)
    took = trainer.call("unpublish", model="m", version=1)
    assert took["end"] - took["start"] < 1.0


def test_holder_killed_mid_pull_raises_source_lost_within_seconds(hubs, tmp_path):
    trainer, reader = hubs("trainer"), hubs("reader", read_workers=1)
    trainer.call("publish", model="m", version=1, specs=BIG, seed=1, chunk_size=CHUNK)
    marks = str(tmp_path / "progress")
    reader.send("pull", model="m", version=1, specs=BIG, pace_s=0.1, progress_file=marks)
    wait_for_progress(marks)
    killed_at = time.monotonic()
    trainer.kill()
    with pytest.raises(RemoteError) as err:
        reader.result(timeout=60)
    noticed = time.monotonic() - killed_at
    assert err.value.type_name == "SourceLost", err.value
    assert "'m' version 1" in err.value.message and "trainer" in err.value.message
    assert noticed < 10, f"SourceLost took {noticed:.1f}s"


def test_failover_to_another_holder_mid_pull(hubs, tmp_path):
    trainer, mirror, reader = hubs("trainer"), hubs("mirror"), hubs("reader", read_workers=1)
    trainer.call("publish", model="m", version=1, specs=BIG, seed=1, chunk_size=CHUNK)
    mirror.call("pull", model="m", version=1, specs=BIG, serve=True)
    marks = str(tmp_path / "progress")
    reader.send("pull", model="m", version=1, specs=BIG, expect_seed=1, pace_s=0.1, progress_file=marks)
    wait_for_progress(marks)
    mirror.kill()  # the reader prefers the mirror over the trainer (origin)
    got = reader.result(timeout=60)
    assert got["mismatched"] == []
    assert got["lost"] == ["mirror"]
    assert got["sources"].get("trainer", 0) > 0 and got["sources"].get("mirror", 0) > 0


def test_server_restart_clients_reregister_and_pull_again():
    specs = mixed_specs(12, largest_bytes=1 << 20)
    with (ServerProcess() as server,
          HubProcess(server.address, name="trainer", heartbeat_interval_s=0.2) as trainer,
          HubProcess(server.address, name="reader", heartbeat_interval_s=0.2) as reader):
        trainer.call("publish", model="m", version=4, specs=specs, seed=4)
        assert reader.call("pull", model="m", specs=specs, expect_seed=4)["mismatched"] == []
        server.kill()
        with pytest.raises(RemoteError) as err:
            reader.call("pull", model="m", specs=specs, timeout=60)
        assert err.value.type_name == "ServerUnavailable"
        server.start()
        deadline = time.monotonic() + 15
        while True:  # the trainer's heartbeat notices the new instance and re-registers
            with contextlib.suppress(RemoteError):  # not listed again yet
                if reader.call("latest", model="m") == 4:
                    break
            assert time.monotonic() < deadline, "replica was not re-registered after the restart"
            time.sleep(0.2)
        got = reader.call("pull", model="m", specs=specs, expect_seed=4)
        assert got["mismatched"] == [] and got["version"] == 4
        assert trainer.process.is_alive() and reader.process.is_alive()


def test_unpublish_while_the_server_is_down_waits_its_timeout_and_says_it_cannot_tell():
    with ServerProcess() as server, HubProcess(server.address, name="trainer", rpc_timeout_s=1.0) as trainer:
        trainer.call("publish", model="m", version=1, specs=BIG, seed=1)
        server.kill()
        trainer.send("unpublish", model="m", version=1, timeout=0.5)  # shorter than the lease TTL
        with pytest.raises(RemoteError) as err:
            trainer.result(timeout=60)
        trainer.kill()  # closing would wait out its other unpublishes with the server gone
    assert err.value.type_name == "UnpublishTimeout", err.value
    assert "could not say whether readers still held read leases" in str(err.value), err.value
    assert "-1" not in str(err.value)
