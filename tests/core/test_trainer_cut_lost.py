"""A trainer rank that dies after publishing its share of the readers' cut
(``Hub.publish(cut="readers")``, ``client/trainercut.py``): its shards and its
cut go with it. What the contract gives (real processes, real NIXL, a real
gRPC server):

* a reader whose bytes the survivors still hold (the other rank's row shards
  and its share of the cut, or a relay of the version) fails over to them and
  reads them byte-exact, whether the rank died before its pull or during it
  (during it: whether the reader still lacked any of the dead rank's share is
  a race the test does not fix; the bytes are exact either way);
* a reader mid-pull whose bytes only the dead rank held fails with SourceLost
  naming it, never with wrong or missing bytes;
* once the server drops the dead rank's replicas, the version has a hole: a
  new pull of it is VersionNotFound, even for a slice the survivors cover.

The layout (two ranks, uneven rows: rank 0 rows [0, 0.4 R), rank 1 the rest;
TP readers: rows of even tensors, columns of odd ones; ``read_region``):
reader 1's rows all lie in rank 1's shards, its columns in rank 1's share of
the cut; reader 0's first rows only in rank 0's."""

from __future__ import annotations

import pytest

from tensorhub.testing import HubProcess, RemoteError, join_group, wait_for_progress

SPECS = [("a", "bfloat16", (512, 256)), ("b", "bfloat16", (512, 256)), ("c", "float32", (384, 128)),
         ("d", "float32", (256, 96)), ("norm", "float32", (256,)), ("scale", "float32", ())]
CHUNK = 16 << 10


def _cut_version(hubs) -> list[HubProcess]:
    """Two trainer ranks; version 1 read by two TP relays (the read sets the
    ranks learn), version 2 published with its cut."""
    ranks = join_group([hubs(f"rank{r}") for r in range(2)])

    def publish(version: int) -> list[dict]:
        for r, hub in enumerate(ranks):
            hub.send("publish_shard", model="m", version=version, specs=SPECS, seed=version, how="rows", rank=r,
                     world=2, chunk_size=CHUNK, cut="readers")
        return [hub.result() for hub in ranks]

    publish(1)
    for w in range(2):
        _pull(hubs(f"w{w}"), 1, w, serve=True)
    second = publish(2)
    assert all(s["cut_mismatched"] == [] and s["cut_report"]["read_sets"] == 2 for s in second)
    # The plan (greedy by bytes) deals "a" and "c" to rank 0, the columns read
    # ("b", "d") and the scalar (in rank 0's shards only) to rank 1.
    held = [{name for name, _ in s["cut_regions"]} for s in second]
    assert {"a", "c"} <= held[0] and {"b", "d", "scale"} <= held[1], held
    return ranks


def _pull(reader: HubProcess, version: int, w: int, **kw) -> dict:
    got = reader.call("pull", model="m", version=version, specs=SPECS, expect_seed=version, read=("tp", w, 2), **kw)
    assert got["mismatched"] == [], got["mismatched"]
    return got


def _close_cleanly(procs: list[HubProcess]) -> None:
    for proc in procs:
        proc.close(timeout=15)
        assert proc.process.exitcode == 0, (proc.name, proc.process.exitcode)


def test_a_rank_killed_after_publishing_its_cut_its_readers_fail_over_byte_exact(hubs):
    ranks = _cut_version(hubs)
    # A relay of the whole version on another host: the only other copy of rank 0's rows.
    mirror = hubs("mirror", labels={"host": "elsewhere"})
    assert mirror.call("pull", model="m", version=2, specs=SPECS, expect_seed=2, serve=True)["mismatched"] == []
    ranks[0].kill()
    # Reader 1 would read "a" and "c" from rank 0's cut: it reads them from
    # rank 1's row shards (or the mirror), never from the dead rank.
    one = _pull(hubs("e1w1"), 2, 1)
    assert set(one["sources"]) <= {"rank1", "mirror"} and one["sources"].get("rank1", 0) > 0, one["sources"]
    assert sum(one["sources"].values()) == one["nbytes"] and set(one["lost"]) <= {"rank0"}
    # Reader 0's first rows of "a" and "c" were only rank 0's (shards and cut): from the mirror.
    zero = _pull(hubs("e1w0"), 2, 0)
    assert set(zero["sources"]) <= {"rank1", "mirror"} and zero["sources"].get("mirror", 0) > 0, zero["sources"]
    assert sum(zero["sources"].values()) == zero["nbytes"]
    # The survivor withdraws its shards and cut as always; everyone left exits cleanly.
    ranks[1].call("unpublish", model="m", version=2, timeout=30)
    _close_cleanly([ranks[1], mirror])


def test_a_rank_killed_mid_pull_its_readers_fail_over_or_name_the_lost_source(hubs, tmp_path):
    ranks = _cut_version(hubs)
    readers = [hubs(f"e1w{w}", read_workers=1) for w in range(2)]
    marks = [str(tmp_path / f"progress{w}") for w in range(2)]
    for w, reader in enumerate(readers):
        reader.send("pull", model="m", version=2, specs=SPECS, expect_seed=2, read=("tp", w, 2), pace_s=0.2,
                    progress_file=marks[w])
    for mark in marks:
        wait_for_progress(mark)
    ranks[0].kill()
    # Reader 1: byte-exact. What it still lacked of rank 0's cut when rank 0
    # died (if anything: its READs of it may all have landed by then) came
    # from rank 1's shards.
    one = readers[1].result(timeout=60)
    assert one["mismatched"] == [] and set(one["lost"]) <= {"rank0"}, (one["mismatched"], one["lost"])
    assert set(one["sources"]) <= {"rank0", "rank1"} and one["sources"].get("rank1", 0) > 0
    assert sum(one["sources"].values()) == one["nbytes"]
    # Reader 0: rank 0's rows had no other holder.
    with pytest.raises(RemoteError) as err:
        readers[0].result(timeout=60)
    assert err.value.type_name == "SourceLost" and "rank0" in err.value.message, err.value
    # The server dropped rank 0's replicas: version 2 has a hole now, for every new reader.
    with pytest.raises(RemoteError) as err:
        hubs("e2w1").call("pull", model="m", version=2, specs=SPECS, read=("tp", 1, 2))
    assert err.value.type_name == "VersionNotFound" and "not complete" in err.value.message, err.value
    ranks[1].call("unpublish", model="m", version=2, timeout=30)
    _close_cleanly([ranks[1], *readers])
