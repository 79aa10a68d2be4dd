"""What the hub holds right now, as an operator sees it (``tensorhub status``).

    reference server State ──describe()──▶ HubStatus ──wire.py──▶ Describe RPC
      ──client/rpc.py──▶ HubStatus ──▶ rich tables, or JSON (``HubStatus.to_json``)

Plain frozen dataclasses, so the server builds them from its state, one codec
(``proto/wire.py``) carries them, and nothing here sees protobuf. Times are
seconds from the moment the server answered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tensorhub.topology import Labels, Reliability


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentView:
    agent_id: str
    name: str
    labels: Labels
    reliability: Reliability
    expires_in_s: float  # without a heartbeat, the agent and its replicas are gone this soon


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaView:
    replica_id: str
    agent_id: str
    complete: bool
    chunks_present: int
    num_chunks: int
    origin: bool  # published by its producer (a trainer), not received by a pull
    retained: bool  # a host copy kept so that a retained version stays pullable
    withdrawn: bool  # unpublishing: waiting for its readers to finish
    held_regions: int  # 0: every tensor whole
    held_bytes: int
    active_reads: int  # read leases on it
    trainer_cut: bool = False  # a trainer rank's copy of its readers' cut, beside its shards


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionView:
    version: int
    visible: bool  # complete: its complete replicas cover every element of every tensor
    fingerprint: str
    tensors: int
    total_bytes: int
    missing: str  # what no complete holder has, when not visible
    replicas: tuple[ReplicaView, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelView:
    model: str
    versions: tuple[VersionView, ...]  # ascending


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseView:
    """A reader in flight: a read lease on the sources it may be reading."""

    lease_id: str
    agent_id: str
    replica_ids: tuple[str, ...]
    expires_in_s: float


@dataclass(slots=True, kw_only=True)
class ControlView:
    """What the control plane sent since the server started: holders sent whole
    against lean (the reader knew their layout: ``steady state``), and pulls
    that replayed their plans against those that planned, as readers report them."""

    resolves: int = 0
    holders_full: int = 0
    holders_lean: int = 0
    answer_bytes: int = 0
    pulls_replayed: int = 0
    pulls_planned: int = 0
    publishes_full: int = 0
    publishes_lean: int = 0
    answers_shared: int = 0  # members answered by another member's Resolve (one per engine: ``members``)
    # Resolves that named their previous pull's holders (``named_layouts``): answered with
    # those alone (no ranking: the steady state), or, one of them missing, ranked as usual
    answers_named: int = 0
    named_missed: int = 0
    # Relays' announces sent ahead with their group's resolve (``ResolveRequest.announces``): a steady
    # step's engine then sends two messages, not three
    announces_ahead: int = 0
    calls: dict[str, int] = field(default_factory=dict)  # every RPC received, by method (Publish, Resolve, ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class HubStatus:
    instance_id: str
    uptime_s: float
    agents: tuple[AgentView, ...]
    models: tuple[ModelView, ...]
    leases: tuple[LeaseView, ...]
    control: ControlView = field(default_factory=ControlView)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values: labels as an object, reliability as its name."""

        def plain(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            if isinstance(value, Reliability):
                return value.value
            return value

        return plain(asdict(self))


# ---------------------------------------------------------------- rendering


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _where(labels: Labels) -> str:
    return "/".join(x or "-" for x in (labels.zone, labels.rack, labels.host))


def render(status: HubStatus, console: Any | None = None) -> None:
    """Print ``status`` as rich tables: versions, holders, readers in flight, agents."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    agents = {a.agent_id: a for a in status.agents}
    where: dict[str, tuple[str, int]] = {}  # replica id -> (model, version)
    owner: dict[str, str] = {}  # replica id -> agent id

    def name(agent_id: str) -> str:
        agent = agents.get(agent_id)
        return agent.name if agent is not None else agent_id

    console.print(f"reference server {status.instance_id[:8]}, up {status.uptime_s:.0f} s: {len(status.agents)} "
                  f"agents, {len(status.models)} models, {len(status.leases)} readers in flight")
    # Cells fold instead of ending in "...": a narrow terminal still shows every word.
    versions = Table(title="versions")
    for col in ("model", "version", "state", "tensors", "bytes", "complete holders", "filling", "missing"):
        versions.add_column(col, justify="left" if col in ("model", "state", "missing") else "right", overflow="fold")
    holders = Table(title="holders")
    for col in ("version", "agent", "zone/rack/host", "state", "chunks", "regions", "bytes", "reads", "role"):
        holders.add_column(col, justify="right" if col in ("chunks", "regions", "bytes", "reads") else "left",
                           overflow="fold")
    for model in status.models:
        for v in model.versions:
            complete = sum(r.complete for r in v.replicas)
            versions.add_row(model.model, str(v.version), "complete" if v.visible else "filling", str(v.tensors),
                             _bytes(v.total_bytes), str(complete), str(len(v.replicas) - complete),
                             "" if v.visible else v.missing)
            for r in v.replicas:
                where[r.replica_id] = (model.model, v.version)
                owner[r.replica_id] = r.agent_id
                agent = agents.get(r.agent_id)
                spot = agent is not None and agent.reliability is Reliability.SPOT
                role = ", ".join(x for x, on in (("origin", r.origin), ("reader", not r.origin),
                                                 ("retained", r.retained), ("trainer cut", r.trainer_cut),
                                                 ("unpublishing", r.withdrawn),
                                                 ("spot", spot)) if on)
                holders.add_row(f"{model.model} v{v.version}", name(r.agent_id),
                                _where(agent.labels) if agent else "?",
                                "complete" if r.complete else "filling", f"{r.chunks_present}/{r.num_chunks}",
                                str(r.held_regions) if r.held_regions else "whole", _bytes(r.held_bytes),
                                str(r.active_reads), role)
    readers = Table(title="readers in flight (read leases)")
    for col in ("reader", "zone/rack/host", "reading", "sources", "expires in"):
        readers.add_column(col, overflow="fold")
    for lease in status.leases:
        agent = agents.get(lease.agent_id)
        reading = sorted({f"{where[rid][0]} v{where[rid][1]}" for rid in lease.replica_ids if rid in where})
        sources = [name(owner[rid]) for rid in lease.replica_ids if rid in owner]
        readers.add_row(name(lease.agent_id), _where(agent.labels) if agent else "?", ", ".join(reading) or "-",
                        ", ".join(sources) or "-", f"{lease.expires_in_s:.1f} s")
    agent_table = Table(title="agents")
    for col in ("agent", "zone/rack/host", "reliability", "expires in"):
        agent_table.add_column(col, overflow="fold")
    for a in status.agents:
        agent_table.add_row(a.name, _where(a.labels), a.reliability.value, f"{a.expires_in_s:.1f} s")
    for table in (versions, holders, readers, agent_table):
        if table.row_count:
            console.print(table)
    c = status.control
    if c.resolves or c.publishes_full or c.publishes_lean:
        console.print(f"control plane: {c.resolves:,} resolves ({_bytes(c.answer_bytes)} answered), holders sent "
                      f"whole {c.holders_full:,} / lean {c.holders_lean:,}; publishes whole {c.publishes_full:,} / by "
                      f"layout {c.publishes_lean:,}; pulls replayed {c.pulls_replayed:,} / planned {c.pulls_planned:,}"
                      + (f"; {c.answers_shared:,} members answered by their engine's resolve" if c.answers_shared
                         else "")
                      + (f"; answered with the holders read before {c.answers_named:,} / ranked anew "
                         f"{c.named_missed:,}" if c.answers_named or c.named_missed else "")
                      + (f"; {c.announces_ahead:,} announces sent ahead with a resolve" if c.announces_ahead
                         else ""))
    if c.calls:
        console.print("messages received: " + ", ".join(f"{name} {n:,}" for name, n in
                                                        sorted(c.calls.items(), key=lambda kv: -kv[1])))

