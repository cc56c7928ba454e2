"""The Grafana dashboard (examples/grafana/p2ptrain.json) against the metrics a peer exports: every metric an
expression names exists, and every exported metric is charted or listed here as deliberately not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from p2ptrain.metrics import PeerMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "p2ptrain.json"
#: Exported, not charted, and why.
NOT_CHARTED = {
    "p2ptrain_inner_steps_total": "progress is the tokens-per-second panel; a count of steps says little across peers",
    "p2ptrain_tokens_total": "the tokens-per-second panel is its rate",
    "p2ptrain_last_checkpoint_timestamp_seconds": "the checkpoint-age panel is the same, relative to now",
}
#: PromQL words that are not metric names (functions, aggregations, modifiers, the variable query).
PROMQL_WORDS = {"sum", "rate", "irate", "increase", "avg", "max", "min", "count", "by", "without", "on", "ignoring",
                "group_left", "group_right", "histogram_quantile", "label_values", "offset", "and", "or", "unless",
                "bool", "topk", "bottomk", "quantile", "le"}
HISTOGRAM = ("_bucket", "_sum", "_count")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # a row's panels


def _expressions(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(d["panels"]) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    bare = re.sub(r'"[^"]*"', '""', expr)  # string literals ("$run", ".*")
    bare = re.sub(r"\{[^}]*\}", "", bare)  # label matchers
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # grouping labels
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        after = bare[m.end():].lstrip()
        if m.group() not in PROMQL_WORDS and not after.startswith("("):
            names.add(m.group())
    return names


def exported() -> dict[str, str]:
    """Every series name a peer exports (``_created`` aside) -> the metric's own name."""
    out = {}
    for family in PeerMetrics(method="streaming", region="").registry.collect():
        if family.type == "counter":
            out[family.name + "_total"] = family.name + "_total"
        elif family.type == "histogram":
            out |= {family.name + s: family.name for s in HISTOGRAM}
        elif family.type == "info":
            out[family.name + "_info"] = family.name + "_info"
        else:
            out[family.name] = family.name
    return out


def test_the_metric_names_of_an_expression() -> None:
    expr = 'histogram_quantile(0.95, sum by (le) (rate(p2ptrain_round_duration_seconds_bucket{run=~"$run"}[5m])))'
    assert metric_names(expr) == {"p2ptrain_round_duration_seconds_bucket"}
    assert metric_names('label_values(p2ptrain_build_info{run=~"$run"}, instance)') == {"p2ptrain_build_info", "instance"}


def test_every_charted_metric_is_exported() -> None:
    names = exported()
    for expr in _expressions(_dashboard()):
        found = metric_names(expr)
        if expr.startswith("label_values("):  # its second argument is a label
            found = {n for n in found if n.startswith("p2ptrain_")}
        assert found, expr
        unknown = found - set(names)
        assert not unknown, f"{expr}: no such metric {sorted(unknown)}"


def test_every_exported_metric_is_charted_or_deliberately_not() -> None:
    names = exported()
    charted = {names[n] for expr in _expressions(_dashboard()) for n in metric_names(expr) if n in names}
    missing = set(names.values()) - charted - set(NOT_CHARTED)
    assert not missing, f"exported but neither charted nor in NOT_CHARTED: {sorted(missing)}"
    assert not charted & set(NOT_CHARTED), "charted after all: take it off NOT_CHARTED"


def test_every_query_is_scoped_to_the_run_and_the_chosen_peers() -> None:
    d = _dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "run", "instance"} <= set(variables)
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]
    for p in _panels(d["panels"]):
        for t in p.get("targets", []):
            assert 'run=~"$run"' in t["expr"] and 'instance=~"$instance"' in t["expr"], t["expr"]
            # a histogram quantile mixes whatever its selector lets in: every bucket series is scoped
            for sel in re.findall(r"p2ptrain_\w+(\{[^}]*\})?", t["expr"]):
                assert sel, t["expr"]


def test_the_peers_table_is_an_instant_table() -> None:
    [table] = [p for p in _panels(_dashboard()["panels"]) if p["type"] == "table"]
    [target] = table["targets"]
    assert target["format"] == "table" and target["instant"] is True
