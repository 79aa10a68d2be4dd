"""Emulated hosts (network namespaces on one bridge): NIXL over TCP between
"machines", and a cut link, which NIXL does not report for minutes, turning
into SourceLost through the reader's own progress deadline."""

from __future__ import annotations

import contextlib
import time

import pytest

from tensorhub import netns
from tensorhub.testing import HubProcess, RemoteError, ServerProcess, wait_for_progress

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

SPECS = [("w", "float32", ((64 << 20) // 4,))]  # 64 MiB in 1 MiB chunks: ~0.6 s at 1 Gbit/s
CHUNK = 1 << 20


@pytest.fixture
def hosts():
    with netns.Hosts(["server", "trainer", "rollout"], rate="1gbit") as h:
        yield h


def _hub(hosts, name, server, zone="", **config):
    # UCX must not use shared memory between "hosts": that would bypass the links.
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    return HubProcess(server.address, name=name, netns=hosts.netns(name), env=env,
                      labels={"host": name, "zone": zone}, **config)


@contextlib.contextmanager
def _cluster(readers, *, specs=SPECS, zones=None, zone_link=None, exits=None, **config):
    """Emulated hosts: a server, a trainer holding version 1 of ``specs``, and a
    hub per reader (``config`` for theirs); every process closed afterwards, its
    exit code put in ``exits`` by name (when given)."""
    zones = zones or {}
    names = ["server", "trainer", *readers]
    with netns.Hosts(names, rate="1gbit", zones=zones or None, zone_link=zone_link) as hosts, \
            ServerProcess(host=hosts.addr("server"), netns=hosts.netns("server"), retain=0) as server:
        trainer = _hub(hosts, "trainer", server, zones.get("trainer", ""))
        hubs = [_hub(hosts, name, server, zones.get(name, ""), **config) for name in readers]
        try:
            trainer.call("publish", model="m", version=1, specs=specs, seed=1, chunk_size=CHUNK)
            yield hosts, hubs
        finally:
            for proc in [*hubs, trainer]:
                proc.close(timeout=15)
                if exits is not None:
                    exits[proc.name] = proc.process.exitcode


def test_pull_across_hosts_and_a_cut_link_becomes_source_lost(hosts, tmp_path):
    with ServerProcess(host=hosts.addr("server"), netns=hosts.netns("server"), retain=0) as server, \
            _hub(hosts, "trainer", server) as trainer, \
            _hub(hosts, "rollout", server, read_workers=1, chunk_timeout_s=2.0) as rollout:
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1, chunk_size=CHUNK)
        got = rollout.call("pull", model="m", specs=SPECS, expect_seed=1)
        assert got["mismatched"] == [] and got["sources"] == {"trainer": 64 << 20}
        assert got["seconds"] > 0.3, "64 MiB at 1 Gbit/s cannot take less: the bytes bypassed the link"

        marks = str(tmp_path / "progress")
        rollout.send("pull", model="m", specs=SPECS, pace_s=0.05, progress_file=marks)
        wait_for_progress(marks)
        cut_at = time.monotonic()
        hosts.cut("trainer")
        with pytest.raises(RemoteError) as err:
            rollout.result(timeout=120)
        noticed = time.monotonic() - cut_at
        assert err.value.type_name in ("SourceLost", "TransferStalled"), err.value
        assert noticed < 20, f"a cut link took {noticed:.1f}s to surface"
        trainer.kill()  # behind its cut link it could only wait out its unpublish timeouts


def test_readers_that_start_together_relay_chunks_instead_of_all_reading_the_trainer():
    with _cluster(["r0", "r1", "r2", "r3"]) as (_, readers):
        for reader in readers:
            reader.send("pull", model="m", specs=SPECS, expect_seed=1, serve=True)
        results = [reader.result(timeout=120) for reader in readers]
    assert all(r["mismatched"] == [] for r in results)
    size = 64 << 20
    from_trainer = sum(r["sources"].get("trainer", 0) for r in results)
    assert all(sum(r["sources"].values()) == size for r in results)
    detail = f"the trainer sent {from_trainer / size:.2f} copies; " + "; ".join(
        f"{r['seconds']:.2f} s from {r['sources']}" for r in results)
    print(detail, "; news heard:", [r["news_heard"] for r in results], "resolves:", [r["refreshes"] for r in results])
    assert from_trainer <= 1.5 * size, detail
    # The relays told each other what they landed (NIXL notifications, client/peernews.py)
    assert sum(r["news_heard"] for r in results) > 0, [r["news_heard"] for r in results]


def test_a_reader_that_starts_late_subscribes_to_the_relay_it_reads_and_hears_what_it_landed_before(tmp_path):
    """r0 starts alone, so its own answer lists nobody to tell; r1 starts once
    r0 has landed chunks, reads from it and subscribes (a NIXL notification
    with r1's metadata, client/peernews.py): r0 takes it as a subscriber and
    tells it at once what it landed before, then every landing."""
    with _cluster(["r0", "r1"]) as (_, (r0, r1)):
        marks = str(tmp_path / "progress")
        r0.send("pull", model="m", specs=SPECS, expect_seed=1, serve=True, pace_s=0.05, progress_file=marks)
        wait_for_progress(marks)
        r1.send("pull", model="m", specs=SPECS, expect_seed=1, serve=True)
        first, late = r0.result(timeout=120), r1.result(timeout=120)
    assert first["mismatched"] == [] and late["mismatched"] == []
    assert first["subscribers"] == 1, first
    assert late["news_heard"] > 0 and late["sources"].get("r0", 0) > 0, late


def test_a_relaying_reader_killed_mid_pull_costs_the_others_a_replan_not_the_pull(tmp_path):
    exits = {}
    with _cluster(["r0", "r1", "r2", "r3"], chunk_timeout_s=3.0, exits=exits) as (_, readers):
        marks = str(tmp_path / "progress")
        readers[0].send("pull", model="m", specs=SPECS, serve=True, progress_file=marks)
        for reader in readers[1:]:
            reader.send("pull", model="m", specs=SPECS, expect_seed=1, serve=True)
        wait_for_progress(marks, at_least=4 << 20)
        # Killed mid-transfer, with requests out to its holders and holders'
        # WRITEs into it in flight. Over TCP a READ would be emulated, and a
        # reader killed mid-READ could abort the peer serving it (UCX's fatal
        # error on a failed reply, docs/history/fault-campaign.md); pull by push
        # (auto, as UCX_TLS is tcp) leaves every peer alive.
        readers[0].kill()  # it served some chunks and owned others
        results = [reader.result(timeout=120) for reader in readers[1:]]
    assert all(r["mismatched"] == [] for r in results)
    assert all(sum(r["sources"].values()) == 64 << 20 for r in results)
    assert {name: code for name, code in exits.items() if name != "r0"} == dict.fromkeys(
        ["r1", "r2", "r3", "trainer"], 0), exits  # every survivor lived and closed cleanly


def test_two_zones_joined_by_a_slow_link_carry_about_one_copy_across_it():
    """The trainer and r0 in zone a; r1, r2, r3 in zone b behind 200 Mbit/s."""
    zones = {"server": "a", "trainer": "a", "r0": "a", "r1": "b", "r2": "b", "r3": "b"}
    specs, size = [("w", "float32", ((32 << 20) // 4,))], 32 << 20
    with _cluster(["r0", "r1", "r2", "r3"], specs=specs, zones=zones, zone_link="200mbit") as (hosts, readers):
        before = hosts.zone_link_bytes()
        for reader in readers:
            reader.send("pull", model="m", specs=specs, expect_seed=1, serve=True)
        results = [reader.result(timeout=120) for reader in readers]
        crossed = hosts.zone_link_bytes() - before
    assert all(r["mismatched"] == [] and sum(r["sources"].values()) == size for r in results)
    detail = f"{crossed / size:.2f} copies crossed the zone link; " + "; ".join(
        f"{r['seconds']:.2f} s from {r['sources']}" for r in results)
    print(detail)
    assert crossed <= 1.3 * size, detail  # three readers in zone b: without seeding, three copies


def test_a_reader_joining_halfway_reads_most_of_its_bytes_from_peers(tmp_path):
    with _cluster(["r0", "r1", "late"]) as (_, readers):
        marks = str(tmp_path / "progress")
        readers[0].send("pull", model="m", specs=SPECS, expect_seed=1, serve=True, pace_s=0.03, progress_file=marks)
        readers[1].send("pull", model="m", specs=SPECS, expect_seed=1, serve=True, pace_s=0.03)
        wait_for_progress(marks, at_least=32 << 20)  # halfway
        readers[2].send("pull", model="m", specs=SPECS, expect_seed=1, serve=True)
        results = [reader.result(timeout=120) for reader in readers]
    assert all(r["mismatched"] == [] and sum(r["sources"].values()) == 64 << 20 for r in results)
    late = results[2]["sources"]
    assert late.get("trainer", 0) < 0.5 * (64 << 20), f"the late reader read {late}"


def test_bench_cluster_writes_a_row_per_method(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "cluster.json"
    proc = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "cluster", "--readers", "2", "--size",
                           "16MiB", "--json", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"single", "single-unchecked", "tensorhub", "tensorhub-no-relay", "gloo-broadcast",
                         "nixl-raw-single", "nixl-raw-all", "nixl-raw-relay"}
    for row in rows.values():
        assert row["seconds"] > 0 and row["trainer_egress_bytes"] > 0 and row["trainer_stall_seconds"] >= 0
    assert rows["tensorhub-no-relay"]["trainer_copies"] >= 1.8  # both readers read the trainer
    assert rows["nixl-raw-all"]["trainer_read_copies"] == 2 and rows["nixl-raw-relay"]["trainer_read_copies"] == 1
    assert "lag-free relay" in proc.stdout
    assert "x single" in proc.stdout and "chunk checksums cost" in proc.stdout


def test_readers_of_one_busy_trainer_wait_for_it_rather_than_give_it_up():
    """Found by ``tensorhub bench cluster --readers 16 --size 64MiB --link
    100mbit``: sixteen readers of one trainer, none relaying, starve each
    other's flows for longer than a chunk timeout; each gave the live trainer
    up as stalled and reported it lost, which hid it from all (SourceLost with
    the trainer alive). Here four readers with a chunk timeout far under what
    their shares of the trainer's link take: the server says the trainer is
    alive, so each waits for it (and keeps its lease), and nothing is read
    twice."""
    with _cluster(["r0", "r1", "r2", "r3"], chunk_timeout_s=0.05) as (_, readers):
        for reader in readers:
            reader.send("pull", model="m", specs=SPECS, expect_seed=1, serve=False)
        results = [reader.result(timeout=120) for reader in readers]
    assert all(r["mismatched"] == [] and r["sources"] == {"trainer": 64 << 20} for r in results), results
    assert [r["lost"] for r in results] == [[]] * 4, [r["lost"] for r in results]
    assert all(r["read_bytes"] == 64 << 20 for r in results), [r["read_bytes"] for r in results]
