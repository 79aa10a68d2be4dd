"""``tensorhub bench cluster --readers 1,2,4,8,16`` (``bench.cluster_sweep``):
the pure parts. The reader list, the relay tree's depths, the goals and the
plot, from fixed rows: no hosts, no processes. Timings belong to the
benchmark, not to these tests."""

from __future__ import annotations

import json

import pytest

from tensorhub import cli, netns
from tensorhub.bench.cluster_sweep import (
    chunk_depths,
    depths,
    goals,
    link_bytes_per_s,
    parse_readers,
    plot,
    plot_path,
    tree_summary,
)
from tensorhub.bench.report import Row

MIB = 1 << 20


@pytest.mark.parametrize("text, counts", [
    ("1,2,4,8,16", [1, 2, 4, 8, 16]),
    ("4", [4]),
    (" 8, 2 ,2", [2, 8]),
    ("16,1", [1, 16]),
])
def test_reader_counts_parse_ascending_once_each(text, counts):
    assert parse_readers(text) == counts


@pytest.mark.parametrize("text", ["", "0", "1,,2", "a", "-1", "2,0", "1.5", "4;8"])
def test_a_bad_reader_list_is_refused(text):
    with pytest.raises(ValueError, match="comma list"):
        parse_readers(text)


def test_the_command_line_refuses_a_bad_list_and_what_a_sweep_does_not_take(capsys):
    assert cli.main(["bench", "cluster", "--readers", "1,x"]) == 2
    assert cli.main(["bench", "cluster", "--readers", "1,2", "--hosts", "5"]) == 2
    assert "most --readers + 2" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--readers", "1,2", "--zones", "2"]) == 2
    assert cli.main(["bench", "cluster", "--readers", "1,2", "--delta"]) == 2
    assert cli.main(["bench", "cluster", "--readers", "4", "--plot", "p.png"]) == 2
    assert "needs a list" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--readers", "4", "--versions", "0"]) == 2
    assert "--versions must be >= 1" in capsys.readouterr().err


def test_link_rates_read_as_tc_writes_them():
    assert link_bytes_per_s("100mbit") == 12.5e6
    assert link_bytes_per_s("1gbit") == 125e6
    assert link_bytes_per_s("200kbit") == 25e3
    assert link_bytes_per_s("10mbps") == 10e6  # tc: bps units are bytes per second
    with pytest.raises(ValueError, match="tc rate"):
        link_bytes_per_s("fast")


def test_a_chain_has_one_more_hop_per_reader():
    sources = {"r0": {"trainer": 64}, "r1": {"r0": 60, "trainer": 4}, "r2": {"r1": 64}, "r3": {"r2": 50, "r0": 14}}
    depth, parent = depths(sources)
    assert depth == {"r0": 1, "r1": 2, "r2": 3, "r3": 4}
    assert parent == {"r0": "trainer", "r1": "r0", "r2": "r1", "r3": "r2"}


def test_a_tree_puts_siblings_at_one_depth():
    sources = {"r0": {"trainer": 64}, "r1": {"trainer": 64},
               "r2": {"r0": 64}, "r3": {"r0": 64}, "r4": {"r1": 64}, "r5": {"r4": 64}}
    depth, _ = depths(sources)
    assert depth == {"r0": 1, "r1": 1, "r2": 2, "r3": 2, "r4": 2, "r5": 3}
    assert tree_summary(list(depth.values())) == "depth 1: 2 readers, depth 2: 3, depth 3: 1"
    assert tree_summary([1]) == "depth 1: 1 reader"


def test_a_cycle_stops_at_the_number_of_readers():
    # r0 and r1 got most of their bytes from each other: the chain never reaches the trainer.
    sources = {"r0": {"r1": 40, "trainer": 24}, "r1": {"r0": 40, "trainer": 24}, "r2": {"r1": 64}}
    depth, parent = depths(sources)
    assert depth == {"r0": 3, "r1": 3, "r2": 3}
    assert parent == {"r0": "r1", "r1": "r0", "r2": "r1"}


def test_chunk_depths_trace_each_chunk_so_an_exchange_is_two_hops_not_a_cycle():
    # r0 and r1 each read half from the trainer and the other half from each other;
    # r2 read everything from r1: r1's own half is 2 hops, the half r1 got from r0 is 3.
    half = {c: "trainer" for c in range(4)}
    chunks = {"r0": {**half, **{c: "r1" for c in range(4, 8)}},
              "r1": {**{c: "r0" for c in range(4)}, **{c: "trainer" for c in range(4, 8)}},
              "r2": {c: "r1" for c in range(8)},
              "r3": {0: "r9"},  # a source that is not a reader: the origin
              "r4": {}}  # got nothing
    assert chunk_depths(chunks) == {"r0": 2, "r1": 2, "r2": 3, "r3": 1, "r4": 0}
    # a record that cannot be (a chunk each read from the other) stops at the number of readers
    assert max(chunk_depths({"a": {0: "b"}, "b": {0: "a"}}).values()) <= 2


def test_a_reader_with_several_sources_follows_the_one_it_got_most_from():
    sources = {"r0": {"trainer": 64}, "r1": {"r0": 64},
               "r2": {"trainer": 20, "r0": 20, "r1": 24},  # most from r1: depth 1 + 2
               "r3": {"trainer": 32, "r1": 32},  # a tie: the trainer wins
               "r4": {"r1": 30, "r0": 30, "trainer": 4},  # a tie of readers: the first name
               "r5": {}}  # got nothing (held it already): no hop
    depth, parent = depths(sources)
    assert depth == {"r0": 1, "r1": 2, "r2": 3, "r3": 1, "r4": 2, "r5": 0}
    assert (parent["r2"], parent["r3"], parent["r4"], parent["r5"]) == ("r1", "trainer", "r0", None)
    assert depths({"r0": {"retained-elsewhere": 8}})[0] == {"r0": 1}  # not a reader: the origin


def _row(method: str, readers: int, seconds: float, copies: float, **extra: object) -> Row:
    return Row.of(method, readers, 64 * MIB, [seconds], trainer_egress_bytes=int(copies * 64 * MIB),
                  trainer_copies=copies, cpu_busy=0.5, **extra)


ROWS = [_row("single", 1, 6.0, 1.0, depth=[1]), _row("nixl-raw-single", 1, 5.6, 1.0)] + [
    row for n in (1, 2, 4, 8, 16) for row in (
        _row("tensorhub", n, 6.0 + 0.05 * n, 1.02, depth=[1] * n, parent=["trainer"] * n),
        _row("nixl-raw-relay", n, 5.8 + 0.05 * n, 1.0),
        _row("nixl-raw-all", n, 5.6 * n, float(n)),
        _row("gloo-broadcast", n, 6.0 * n, float(n)))]


def test_goals_are_checked_against_the_rows_of_the_run():
    checked = goals(ROWS)
    by = {g.text.split(":")[0]: g.met for g in checked}
    assert by["16 readers finish <= 1.25x a lone reader, trainer egress <= 1.1 copies"] is True  # 6.8 / 6.0
    assert by["8 readers finish <= 1.15x a lone reader"] is True  # 6.4 / 6.0
    assert by["16 reader(s)"] is True and by["1 reader(s)"] is True
    slow = [r if (r.method, r.readers) != ("tensorhub", 16) else _row("tensorhub", 16, 8.0, 1.3) for r in ROWS]
    by = {g.text.split(":")[0]: g.met for g in goals(slow)}
    assert by["16 readers finish <= 1.25x a lone reader, trainer egress <= 1.1 copies"] is False
    assert by["16 reader(s)"] is False  # 8.0 against 6.6: more than 10% behind the raw relay
    raw16 = next(r for r in ROWS if (r.method, r.readers) == ("nixl-raw-relay", 16))
    for seconds, met in ((raw16.seconds * 1.05, True), (raw16.seconds * 1.2, False)):
        by = {g.text.split(":")[0]: g.met for g in goals([*ROWS, _row("tensorhub-steady", 16, seconds, 1.0)])}
        assert by["16 readers, later versions from the same buffers"] is met
    few = goals([r for r in ROWS if r.readers <= 4])
    assert [g.met for g in few[:2]] == [None, None] and "not measured" in few[0].text


def test_the_plot_is_written_from_rows(tmp_path):
    out = plot(ROWS, tmp_path / "sweep.png", title="64 MiB, 100mbit")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert plot_path(str(tmp_path / "f.json"), None) == tmp_path / "f.png"
    assert plot_path(None, str(tmp_path / "p.png")) == tmp_path / "p.png"
    assert plot_path(None, None) is None


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_a_small_sweep_runs_on_emulated_hosts(tmp_path):
    path = tmp_path / "sweep.json"
    assert cli.main(["bench", "cluster", "--readers", "1,2", "--size", "4MiB", "--versions", "3",
                     "--json", str(path)]) == 0
    got = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    seen = {(r["method"], r["readers"]) for r in got["results"]}
    assert seen == {("single", 1), ("nixl-raw-single", 1)} | {
        (m, n) for m in ("tensorhub", "tensorhub-steady", "nixl-raw-relay", "nixl-raw-all", "gloo-broadcast")
        for n in (1, 2)}
    for row in got["results"]:
        if row["method"].startswith("tensorhub"):
            # the server's own count: every reader resolved, the trainer published; heartbeats left out
            sent = row["messages_per_reader"]
            assert sent["Resolve"] >= 1 and sent["Publish"] >= 1 / row["readers"] and "Heartbeat" not in sent
    steady = next(r for r in got["results"] if (r["method"], r["readers"]) == ("tensorhub-steady", 1))
    # A lone reader of the same buffers replays, by the last version at least. Once in
    # CI (2026-12-07, fresh clone) its first steady pull came planned: "1 holder(s) with
    # a layout this reader had not seen: trainer" (cause not found; NIXL's metadata of a
    # re-registered buffer compares equal). A reader that never replays still fails here.
    assert len(steady["replayed"]) == 2 and steady["replayed"][-1] == 1, steady["not_replayed"]
    for row in got["results"]:
        assert {"method", "readers", "seconds", "trainer_egress_bytes", "bytes", "cpu_busy"} <= set(row)
        if row["method"] in ("tensorhub", "single"):
            assert len(row["reader_seconds"]) == len(row["depth"]) == row["readers"]
            # each reader's deepest chunk: from the trainer (1), or through the other reader (2)
            assert 1 <= min(row["depth"]) <= max(row["depth"]) <= row["readers"]
            assert max(row["trainer_share"]) > 0  # someone read the trainer
    relay = next(r for r in got["results"] if r["method"] == "nixl-raw-relay" and r["readers"] == 2)
    assert relay["trainer_read_copies"] == 1.0
    assert got["sweep"] is True and got["readers"] == [1, 2] and len(got["goals"]) >= 2


def test_the_last_readers_path_stops_at_the_trainer_or_a_reader_seen_before():
    from tensorhub.bench.cluster_sweep import _chain

    chain = _row("tensorhub", 4, 9.0, 1.0, parent=["trainer", "r0", "r3", "r2"])
    assert _chain(chain, 1) == ["r1", "r0", "trainer"]
    assert _chain(chain, 2) == ["r2", "r3", "r2 ..."]  # r2 and r3 gave each other most of their bytes
