"""Publish in one OS process, pull in another: real NIXL, real gRPC."""

from __future__ import annotations

import time

import pytest
import torch

from tensorhub import Hub, InvalidRequest, ManifestMismatch, ServerUnavailable, VersionNotFound
from tensorhub.testing import RemoteError, make_tensors, mixed_specs

SPECS = mixed_specs(210, largest_bytes=64 << 20)


def test_mixed_state_dict_is_byte_exact_across_processes(hubs):
    trainer, rollout = hubs("trainer"), hubs("rollout", chunk_size=8 << 20)
    trainer.call("publish", model="policy", version=3, specs=SPECS, seed=3, chunk_size=8 << 20)
    got = rollout.call("pull", model="policy", version=3, specs=SPECS, expect_seed=3)
    assert got["mismatched"] == []
    assert got["in_place"] is True  # written straight into the given tensors
    assert got["version"] == 3
    assert got["nbytes"] == sum(t.numel() * t.element_size() for t in make_tensors(SPECS, 0).values())
    assert got["sources"] == {"trainer": got["nbytes"]}
    dtypes = {d for _, d, _ in SPECS}
    assert {"float32", "bfloat16", "float16", "int64"} <= dtypes
    assert len(SPECS) >= 200


def test_pull_without_destination_allocates(server, hubs):
    trainer = hubs("trainer")
    specs = SPECS[:20]
    trainer.call("publish", model="m", version=0, specs=specs, seed=11)
    with Hub.connect(server.address, name="local") as hub:
        result = hub.pull("m", 0)
        expected = make_tensors(specs, 11)
        assert list(result.tensors) == [name for name, _, _ in specs]
        assert all(torch.equal(result.tensors[k], v) for k, v in expected.items())
        assert result.gbps > 0


def test_latest_follows_publishes_and_unknown_versions_raise(server, hubs):
    trainer, rollout = hubs("trainer"), hubs("rollout")
    specs = SPECS[:8]
    with pytest.raises(RemoteError) as err:
        rollout.call("pull", model="m", version="latest", specs=specs)
    assert err.value.type_name == "VersionNotFound"
    for version in (1, 2, 5):
        trainer.call("publish", model="m", version=version, specs=specs, seed=version)
        assert rollout.call("latest", model="m") == version
        got = rollout.call("pull", model="m", specs=specs, expect_seed=version)
        assert got["version"] == version and got["mismatched"] == []
    assert rollout.call("versions", model="m") == [1, 2, 5]
    got = rollout.call("pull", model="m", version=2, specs=specs, expect_seed=2)
    assert got["version"] == 2 and got["mismatched"] == []
    with pytest.raises(RemoteError) as err:
        rollout.call("pull", model="m", version=4, specs=specs)
    assert err.value.type_name == "VersionNotFound" and "pullable versions: [1, 2, 5]" in err.value.message
    trainer.call("unpublish", model="m", version=5)
    assert rollout.call("latest", model="m") == 2
    with pytest.raises(RemoteError) as err:
        rollout.call("pull", model="m", version=5, specs=specs)
    assert err.value.type_name == "VersionNotFound"


def test_manifest_mismatch_raises_before_any_byte_moves(server, hubs):
    trainer = hubs("trainer")
    trainer.call("publish", model="m", version=1, specs=[("w", "float32", (4, 4)), ("b", "float32", (4,))], seed=1)
    with Hub.connect(server.address, name="local") as hub:
        into = {"w": torch.full((4, 4), 7.0), "b": torch.full((5,), 7.0)}
        with pytest.raises(ManifestMismatch, match="b: version has float32\\[4\\], destination torch.float32\\[5\\]"):
            hub.pull("m", 1, into=into)
        assert torch.all(into["w"] == 7.0) and torch.all(into["b"] == 7.0)
        with pytest.raises(ManifestMismatch, match="missing 'b'"):
            hub.pull("m", 1, into={"w": torch.zeros(4, 4)})
    # The failed pulls left no read lease behind: unpublish does not wait a lease TTL (5 s here).
    took = trainer.call("unpublish", model="m", version=1)
    assert took["end"] - took["start"] < 2.0


def test_client_side_bad_arguments(server):
    with Hub.connect(server.address, name="local") as hub:
        with pytest.raises(InvalidRequest, match="version"):
            hub.pull("m", -1)
        with pytest.raises(InvalidRequest, match="version"):
            hub.publish("m", "7", {"w": torch.zeros(1)})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="model"):
            hub.pull("", 1)
        with pytest.raises(ValueError, match="contiguous"):
            hub.publish("m", 1, {"w": torch.zeros(3, 2).t()})
        with pytest.raises(VersionNotFound, match="unknown"):
            hub.pull("never-published")
        # nothing above left state behind: a good publish still works
        pub = hub.publish("m", 1, {"w": torch.zeros(1)})
        assert hub.versions("m") == [1]
        pub.unpublish()
        assert hub.versions("m") == []


def test_connect_to_nothing_fails_fast_with_a_clear_error():
    from tensorhub.testing import free_port

    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match="check that `tensorhub server` runs there"):
        Hub.connect(f"127.0.0.1:{free_port()}", connect_timeout_s=1.0, rpc_timeout_s=0.5)
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="host:port"):
        Hub.connect("not an address")


def test_reader_serves_what_it_received_after_the_trainer_unpublished(hubs):
    trainer, first, second = hubs("trainer"), hubs("first", chunk_size=1 << 20), hubs("second")
    specs = SPECS[:40]
    trainer.call("publish", model="m", version=9, specs=specs, seed=9, chunk_size=1 << 20)
    got = first.call("pull", model="m", version=9, specs=specs, expect_seed=9, serve=True)
    assert got["mismatched"] == []
    trainer.call("unpublish", model="m", version=9)
    got = second.call("pull", model="m", version=9, specs=specs, expect_seed=9)
    assert got["mismatched"] == [] and got["sources"] == {"first": got["nbytes"]}
    # chunk by chunk, where its bytes came from: every chunk of the read set, from "first"
    assert sorted(got["chunk_sources"]) == list(range(len(got["chunk_sources"])))
    assert len(got["chunk_sources"]) >= got["nbytes"] // (1 << 20) and set(got["chunk_sources"].values()) == {"first"}


def test_group_members_get_the_version_the_first_member_fixed(hubs):
    trainer, rank0, rank1 = hubs("trainer"), hubs("rank0"), hubs("rank1")
    specs = SPECS[:4]
    trainer.call("publish", model="m", version=1, specs=specs, seed=1)
    assert rank0.call("pull", model="m", specs=specs, group="engine", group_round=0)["version"] == 1
    trainer.call("publish", model="m", version=2, specs=specs, seed=2)
    # rank1 asks for "latest" in the same round: it gets version 1, not 2
    got = rank1.call("pull", model="m", specs=specs, expect_seed=1, group="engine", group_round=0)
    assert got["version"] == 1 and got["mismatched"] == []
    assert rank1.call("pull", model="m", specs=specs, group="engine", group_round=1)["version"] == 2


def test_adjacent_registrations_are_read_in_separate_descriptors(server):
    """Two tensors whose memories touch but are two storages (two NIXL
    registrations): the reader, whose destinations also touch, must not join
    their bytes into one READ descriptor (NIXL finds a descriptor only inside
    one registration: NIXL_ERR_NOT_FOUND)."""
    n = 1 << 16
    raw = bytearray(2 * n * 4)
    first = torch.frombuffer(memoryview(raw)[: n * 4], dtype=torch.float32)
    second = torch.frombuffer(memoryview(raw)[n * 4:], dtype=torch.float32)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert first.data_ptr() + n * 4 == second.data_ptr()
    first.copy_(torch.arange(n, dtype=torch.float32))
    second.copy_(-torch.arange(n, dtype=torch.float32))
    dest = torch.zeros(2 * n)
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="reader") as reader:
        trainer.publish("adjacent", 1, {"a": first, "b": second})
        reader.pull("adjacent", 1, into={"a": dest[:n], "b": dest[n:]}, timeout=30)
    assert torch.equal(dest[:n], first) and torch.equal(dest[n:], second)
