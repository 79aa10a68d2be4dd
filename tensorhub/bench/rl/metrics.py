"""From one method's events to its row: the scenario's metric and the figures
that explain it. Pure: no I/O.

Steps: step k (k = 1..steps) is the window from the start of the trainer's
k-th compute to the start of the next (the last ends with the run). A stall
counts in the window where it starts.

* ``total_stall_s`` (standalone): trainer stall + every rollout's stall in a
  step, median over the steps;
* ``update_s`` (elastic): seconds from a joining rollout's first request until
  it holds the newest version, median over the joins (``join_versions_behind``:
  how many versions the trainer had made available meanwhile that it lacks);
* ``rollout_stall_s`` (crossdc): the rollouts' stall in a step, median.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def step_windows(events: list[dict]) -> list[tuple[float, float]]:
    """The first step starts when the driver starts the run (the trainer's
    compute and the rollouts' first batches start together)."""
    starts = sorted(e["start"] for e in events if e["who"] == "trainer" and e["kind"] == "compute")
    go = [e["start"] for e in events if e["kind"] == "go"]
    if starts and go:
        starts[0] = min(starts[0], go[0])
    end = max(e["end"] for e in events)
    return list(zip(starts, [*starts[1:], end]))


def stall_per_step(events: list[dict], windows: list[tuple[float, float]], *, rollouts_only: bool = False) -> list[float]:
    per = [0.0] * len(windows)
    for e in events:
        if e["kind"] != "stall" or (rollouts_only and e["who"] == "trainer"):
            continue
        for i, (a, b) in enumerate(windows):
            if a <= e["start"] < b:
                per[i] += e["end"] - e["start"]
                break
    return per


def timeline(events: list[dict], t0: float) -> dict[str, list[tuple[float, int]]]:
    """Per process, (seconds since t0, version) whenever it starts holding one;
    version -1 when it was preempted (holds nothing from then on)."""
    out: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["end"]):
        if e["kind"] == "preempted":
            out[e["who"]].append((max(0.0, round(e["end"] - t0, 3)), -1))
            continue
        if e["kind"] in ("hold", "publish") or (e["kind"] == "ready" and e.get("version") is not None):
            at = max(0.0, round(e["end"] - t0, 3))
            if not out[e["who"]] or out[e["who"]][-1][1] != e["version"]:
                out[e["who"]].append((at, e["version"]))
    return dict(out)


def summarize(scenario: str, method: str, events: list[dict], params: dict, carried: dict | None = None) -> dict:
    """The JSON row of one method's run (see tensorhub.bench.rl for the schema);
    ``carried``: the links' byte counters over the run, where there are links."""
    windows = step_windows(events)
    t0 = windows[0][0] if windows else min(e["start"] for e in events)
    total = stall_per_step(events, windows)
    rollout = stall_per_step(events, windows, rollouts_only=True)
    trainer = [t - r for t, r in zip(total, rollout)]
    stalls = [e for e in events if e["kind"] == "stall" and e["who"] != "trainer"]
    joins = [e["end"] - e["start"] for e in stalls if e.get("what") == "join"]
    published = {e["version"]: e["end"] for e in events if e["who"] == "trainer" and e["kind"] == "publish"}
    # How far behind the trainer each join's version was once it held it (p2p: never; the trainer waits).
    behind = [_lag(published, {"start": e["end"], "version": e["version"]}) for e in stalls if e.get("what") == "join"]
    updates = [e["end"] - e["start"] for e in stalls if e.get("what") == "update"]
    staleness = [_lag(published, e) for e in events if e["kind"] == "generate" and e["start"] >= t0]
    moved: dict[str, int] = defaultdict(int)  # broadcast: gloo does not say who sent what
    for e in (e for e in stalls if e["start"] >= t0):
        for source, nbytes in (e.get("sources") or {}).items():
            moved["trainer" if source.startswith("trainer") else "rollouts"] += nbytes
    known = any(e.get("sources") for e in stalls)
    row = {
        "scenario": scenario, "method": method,
        "total_stall_s": round(_median(total), 3),
        "rollout_stall_s": round(_median(rollout), 3),
        "trainer_stall_s": round(_median(trainer), 3),
        "update_s": round(_median(joins), 3),
        "update_s_running": round(_median(updates), 3),
        "joins": len(joins),
        "retries": sum(e.get("retries", 0) for e in stalls),
        "failed_pulls": [f for e in stalls for f in e.get("failures", [])],
        "stall_per_step_s": [round(x, 3) for x in total],
        "rollout_stall_per_step_s": [round(x, 3) for x in rollout],
        "join_update_s": [round(x, 3) for x in joins],
        "join_versions_behind": behind,
        "steps_s": round(windows[-1][1] - t0, 3) if windows else 0.0,
        "batches": len(staleness),
        "mean_staleness": round(statistics.fmean(staleness), 2) if staleness else 0.0,
        "bytes_received": sum(e.get("bytes", 0) for e in stalls if e["start"] >= t0),
        "bytes_from_trainer": moved["trainer"] if known else None,
        "bytes_from_rollouts": moved["rollouts"] if known else None,
        "trainer_egress_bytes": (carried or {}).get("trainer_egress_bytes"),
        "zone_link_bytes": (carried or {}).get("zone_link_bytes"),
        "timeline": timeline(events, t0),
        "params": params,
    }
    if scenario != "elastic":
        for key in ("update_s", "joins", "join_update_s", "join_versions_behind"):
            row.pop(key)
    return row


def per_step_egress(row: dict, steps: int, adapter_bytes: int) -> dict:
    """LoRA mode's figures: the adapter's bytes, and what the trainer's link sent
    per step over them (goal about 1: only the adapter leaves the trainer,
    once; null without link counters, hosts=local)."""
    egress = row.get("trainer_egress_bytes")
    per_step = None if egress is None else egress / steps
    return {"adapter_bytes": adapter_bytes,
            "trainer_egress_per_step_bytes": None if per_step is None else round(per_step),
            "egress_per_step_vs_adapter": None if per_step is None else round(per_step / adapter_bytes, 3)}


def _lag(published: dict[int, float], e: dict) -> int:
    """Versions the trainer had made available when this batch started that the batch's weights lack."""
    newest = max((v for v, at in published.items() if at <= e["start"]), default=0)
    return max(0, newest - e["version"])


def ratio(rows: list[dict], metric: str, baseline: str, method: str = "tensorhub") -> float | None:
    """baseline's metric / method's: how many times less ``method`` stalls (None: not measurable)."""
    base = next((r[metric] for r in rows if r["method"] == baseline), None)
    ours = next((r[metric] for r in rows if r["method"] == method), None)
    return round(base / ours, 2) if base and ours else None
