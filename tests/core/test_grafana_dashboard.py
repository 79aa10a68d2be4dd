"""The Grafana dashboard (docs/operations/grafana-dashboard.json) asks only for
metrics the server exports, with labels those metrics have.

What the server exports is read from its own registry (server/metrics.py), not
from a list kept here: every recording method is called once, so that labelled
series exist too, and each sample's name and label names are collected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tensorhub.proto.wire import TIERS
from tensorhub.server.config import ServerConfig
from tensorhub.server.metrics import PrometheusMetrics
from tensorhub.server.state import State

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "operations" / "grafana-dashboard.json"
# A metric name in PromQL, with its label matchers when it has them: name{a="x", b=~"y"}.
SELECTOR = re.compile(r"\b(tensorhub_[A-Za-z0-9_]*)\s*(\{[^}]*\})?")
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, as a scrape of the server shows them."""
    metrics = PrometheusMetrics(State(ServerConfig()), "127.0.0.1", 0)
    try:
        metrics.resolved(0.001, "ok", True)
        metrics.source_lost()
        metrics.unpublished(0.5, False)
        metrics.served()
        metrics.pulled([(tier, origin, 1) for tier in TIERS for origin in (True, False)])
        samples: dict[str, set[str]] = {}
        for family in metrics.registry.collect():
            for sample in family.samples:
                samples.setdefault(sample.name, set()).update(sample.labels)
        return samples
    finally:
        metrics.stop()


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target, rows' nested panels included."""
    found = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        found += [(panel.get("title", ""), t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
    found += [("templating " + v.get("name", ""), str(v["query"])) for v in dashboard.get("templating", {}).get("list", [])
              if v.get("type") == "query" and "tensorhub_" in str(v.get("query", ""))]
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_in_the_dashboard_is_exported(dashboard):
    names = exported()
    exprs = expressions(dashboard)
    assert len(exprs) >= 10, "the dashboard lost its panels"
    unknown = []
    for title, expr in exprs:
        used = SELECTOR.findall(expr)
        assert used, f"panel {title!r}: {expr!r} uses no tensorhub metric"
        for name, matchers in used:
            if name not in names:
                unknown.append(f"{title!r}: {name}")
                continue
            for label in MATCHER_LABEL.findall(matchers):
                if label not in names[name]:
                    unknown.append(f"{title!r}: {name} has no label {label!r} (it has {sorted(names[name])})")
    assert not unknown, "metrics or labels the server does not export:\n" + "\n".join(unknown)


def test_grouping_labels_belong_to_the_metrics_grouped(dashboard):
    names = exported()
    wrong = []
    for title, expr in expressions(dashboard):
        labels = set().union(*(names.get(name, set()) for name, _ in SELECTOR.findall(expr)))
        for group in GROUPING.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                if label not in labels:
                    wrong.append(f"{title!r}: by ({label}) is not a label of {expr!r}")
    assert not wrong, "\n".join(wrong)

