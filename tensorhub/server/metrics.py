"""Prometheus metrics of the reference server (``tensorhub server --metrics-port P``).

What the server can count is what it sees on the control plane: resolves (a
pull's plan, and its refreshes), read leases, sources reported lost (each one
a reader failing over), unpublish drains, agents and replicas. It never sees
the bytes: the bytes by source tier are what readers report when a pull
finishes (riding on its lease release), so a pull that fails reports none and
a client can report what it likes (the token guards who may). Counts only: no model name, version or agent id appears in a label,
so the unauthenticated HTTP endpoint tells a scraper nothing the token guards.

The counters move on the server's event loop; the gauges are read at scrape
time from the state (on prometheus-client's HTTP thread: len() of a dict and a
walk over the replicas, a consistent enough snapshot for a gauge), so they cost
the RPCs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensorhub.proto.wire import TIERS

if TYPE_CHECKING:
    from tensorhub.server.state import State

# Resolve handling time, seconds: 100 us .. 2.5 s.
RESOLVE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Unpublish drain, seconds: none .. an hour (MAX_DRAIN_S).
UNPUBLISH_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


class NoMetrics:
    """What the service calls when no ``--metrics-port`` was given: nothing."""

    port: int | None = None  # where the metrics are served over HTTP

    def resolved(self, seconds: float, outcome: str, pull_started: bool) -> None:
        pass

    def source_lost(self) -> None:
        pass

    def unpublished(self, seconds: float, drained: bool) -> None:
        pass

    def served(self) -> None:
        pass

    def pulled(self, entries: list[tuple[str, bool, int]]) -> None:
        """(tier name, from an origin, bytes) a reader reported for its finished pulls."""

    def stop(self) -> None:
        pass


class PrometheusMetrics(NoMetrics):
    """The server's metrics in their own registry (several embedded servers may
    share a process), served over HTTP on ``host:port`` (0: a free port, see ``.port``)."""

    def __init__(self, state: State, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

        self.registry = CollectorRegistry()
        self._resolve_seconds = Histogram(
            "tensorhub_resolve_seconds", "Time the server took to answer a Resolve (from the handler's start; gRPC's "
            "own queueing not included)", registry=self.registry, buckets=RESOLVE_BUCKETS)
        self._resolves = Counter("tensorhub_resolves", "Resolve calls answered, by outcome (ok, not_found, error)",
                                 ["outcome"], registry=self.registry)
        self._pulls = Counter("tensorhub_pulls", "Pulls started: a Resolve taking a read lease from an agent that "
                              "held no other read lease", registry=self.registry)
        self._served = Counter("tensorhub_pulls_served", "Serving pulls that completed: a reader's filling replica "
                               "reported complete", registry=self.registry)
        self._lost = Counter("tensorhub_sources_lost", "Sources reported lost by their readers (each a failover to "
                             "other holders)", registry=self.registry)
        self._unpublish = Histogram("tensorhub_unpublish_wait_seconds", "Time an Unpublish waited for the replica's "
                                    "readers to finish", registry=self.registry, buckets=UNPUBLISH_BUCKETS)
        self._unpublish_timeouts = Counter("tensorhub_unpublish_timeouts", "Unpublish calls whose readers were "
                                           "still reading at the drain deadline", registry=self.registry)
        self._pulled = Counter("tensorhub_pulled_bytes", "Bytes finished pulls read, as their readers report them, "
                               "by source tier (same_host, same_rack, same_zone, other_zone) and source (origin: a "
                               "publisher such as the trainer; relay: a reader serving what it pulled)",
                               ["tier", "source"], registry=self.registry)
        for tier in TIERS:  # every series exists from the start, at 0
            for source in ("origin", "relay"):
                self._pulled.labels(tier, source)
        self.registry.register(_StateCollector(state))
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port: int = self._httpd.server_port

    def resolved(self, seconds: float, outcome: str, pull_started: bool) -> None:
        self._resolve_seconds.observe(seconds)
        self._resolves.labels(outcome).inc()
        if pull_started:
            self._pulls.inc()

    def source_lost(self) -> None:
        self._lost.inc()

    def unpublished(self, seconds: float, drained: bool) -> None:
        self._unpublish.observe(seconds)
        if not drained:
            self._unpublish_timeouts.inc()

    def served(self) -> None:
        self._served.inc()

    def pulled(self, entries: list[tuple[str, bool, int]]) -> None:
        for tier, origin, nbytes in entries:
            self._pulled.labels(tier, "origin" if origin else "relay").inc(nbytes)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


# The control plane's counters (``State.control``) by label: (metric, help, label, ((value, field), ...)).
_CONTROL_COUNTERS = (
    ("tensorhub_resolve_holders", ("Holders sent in Resolve answers: full (with their regions and memory) or lean "
     "(the reader knew their layout)"), "form", (("full", "holders_full"), ("lean", "holders_lean"))),
    ("tensorhub_pull_paths", ("Finished pulls by path, as readers report them: replayed (an earlier pull's plans, "
     "every holder's layout known) or planned"), "path", (("replayed", "pulls_replayed"), ("planned", "pulls_planned"))),
    ("tensorhub_publishes", ("Publish requests: full (regions and memory sent) or lean (naming a layout published "
     "before)"), "form", (("full", "publishes_full"), ("lean", "publishes_lean"))),
    ("tensorhub_resolve_answers", ("Readers answered: by a Resolve of their own, or shared (another member of their "
     "engine resolved for the group)"), "how", (("own", "resolves"), ("shared", "answers_shared"))),
    ("tensorhub_resolve_named", ("Resolves that named the holders of the reader's previous pull: answered with "
     "those alone (the steady state), or ranked anew (one of them was missing)"), "outcome",
     (("named", "answers_named"), ("missed", "named_missed"))),
    ("tensorhub_announces_sent_with_resolve", ("Relays' announces sent ahead with their engine's Resolve (the "
     "steady state: one message fewer per engine and step; each also counts as a publish)"), "how",
     (("ahead", "announces_ahead"),)),
)


class _StateCollector:
    """Gauges read from the state at scrape time."""

    def __init__(self, state: State) -> None:
        self._state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self._state
        yield GaugeMetricFamily("tensorhub_agents", "Registered agents (alive: heartbeating within their TTL)",
                                value=len(state.agents))
        yield GaugeMetricFamily("tensorhub_read_leases", "Read leases held: readers in flight", value=len(state.leases))
        replicas = GaugeMetricFamily("tensorhub_replicas", "Replicas by state", labels=["state"])
        counts = {"complete": 0, "filling": 0, "withdrawn": 0}
        for r in list(state.replicas.values()):
            counts["withdrawn" if r.withdrawn else "complete" if r.complete else "filling"] += 1
        for name, n in counts.items():
            replicas.add_metric([name], n)
        yield replicas
        versions = GaugeMetricFamily("tensorhub_versions", "Versions held, by whether they are complete (visible)",
                                     labels=["visible"])
        entries = [e for model in list(state.models.values()) for e in list(model.values())]
        versions.add_metric(["true"], sum(e.visible for e in entries))
        versions.add_metric(["false"], sum(not e.visible for e in entries))
        yield versions
        control = state.control
        yield CounterMetricFamily("tensorhub_resolve_answer_bytes", "Bytes of Resolve answers sent",
                                  value=control.answer_bytes)
        for name, doc, label, counts in _CONTROL_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, field in counts:
                family.add_metric([value], getattr(control, field))
            yield family
        messages = CounterMetricFamily("tensorhub_messages", "Messages (RPCs) the server received, by method, "
                                       "refused ones too: what the control plane costs", labels=["method"])
        for method, n in sorted(dict(control.calls).items()):
            messages.add_metric([method], n)
        yield messages
