"""The chart's monitoring objects: the PrometheusRule of pdserve's alerts and the Grafana
dashboard's ConfigMap are off by default and render when asked; every expression parses as PromQL
and names only metrics pdserve exports (a renamed metric fails here, not silently in an
operator's Grafana), and the thresholds come from the values."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.ops.helm_render import CHART, Obj, RenderError, helm_binary, of_kind, render

promql = pytest.importorskip("promql_parser", reason="promql-parser is a dev dependency (make install)")

pytestmark = pytest.mark.skipif(
    helm_binary() is None, reason="helm is not installed: `make tools` installs it into .tools/bin"
)

BOTH = ("--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.grafanaDashboard.enabled=true")
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*"}
_METRIC = re.compile(r"\b(pdserve_[a-z0-9_]+|process_[a-z0-9_]+)\b")


def _exported() -> set[str]:
    """Every series name pdserve's metrics (and prometheus_client's process collector) expose."""
    from prometheus_client import REGISTRY

    from shared import metrics  # noqa: F401  (defines every pdserve_ metric on the registry)

    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def _check_expr(expr: str) -> None:
    promql.parse(expr)  # raises ValueError naming the problem
    unknown = set(_METRIC.findall(expr)) - _exported()
    assert not unknown, f"{sorted(unknown)} in {expr!r} are not exported"


def _rules(objs: list[Obj]) -> list[dict[str, Any]]:
    (rule,) = of_kind(objs, "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    return list(group["rules"])


def test_nothing_by_default_and_nothing_without_metrics() -> None:
    for objs in (render(), render(*BOTH, "--set", "metrics.enabled=false")):
        assert of_kind(objs, "PrometheusRule") == []
        assert [c for c in of_kind(objs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")] == []


def test_alerts_parse_name_exported_metrics_and_say_what_to_do() -> None:
    rules = _rules(render(*BOTH, "--set", "metrics.prometheusRule.labels.release=kps"))
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names) >= 10
    for rule in rules:
        # the fields and types of the Prometheus Operator's CRD (kubernetes-validate has no
        # schema for it): a rule the operator refuses would never load
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", rule.get("for", "1m")), rule
        assert all(isinstance(v, str) for v in [*rule["labels"].values(), *rule["annotations"].values()])
        _check_expr(rule["expr"])
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40
        assert 'namespace="default"' in rule["expr"]  # the release's own series only
    (obj,) = of_kind(render(*BOTH, "--set", "metrics.prometheusRule.labels.release=kps"), "PrometheusRule")
    assert obj["metadata"]["labels"]["release"] == "kps"


def test_thresholds_come_from_the_values_and_extra_rules_are_appended() -> None:
    rules = {
        r.get("alert", r.get("record")): r
        for r in _rules(
            render(
                *BOTH,
                "--set",
                "metrics.prometheusRule.ttftP99Seconds=2.5",
                "--set",
                "metrics.prometheusRule.kvCacheUsage=0.8",
                "--set",
                "metrics.prometheusRule.serverErrorRatio=0.01",
                "--set-json",
                'metrics.prometheusRule.extraRules=[{"alert":"Mine","expr":"up == 0","for":"1m"}]',
            )
        )
    }
    assert rules["PdserveSlowFirstToken"]["expr"].rstrip().endswith("> 2.5")
    assert rules["PdserveKvCacheFull"]["expr"].endswith("> 0.8")
    assert rules["PdserveServerErrors"]["expr"].rstrip().endswith("> 0.01")
    assert rules["Mine"] == {"alert": "Mine", "expr": "up == 0", "for": "1m"}
    with pytest.raises(RenderError, match="kvCacheUsage"):
        render(*BOTH, "--set-json", "metrics.prometheusRule.kvCacheUsage=2")  # values.schema.json
    with pytest.raises(RenderError, match="ttftP99Seconds"):
        render(*BOTH, "--set", "metrics.prometheusRule.ttftP99Seconds=soon")


def test_the_dashboard_is_found_by_grafanas_sidecar_and_every_panel_queries_exported_metrics() -> None:
    objs = render(*BOTH, "--set", "metrics.grafanaDashboard.namespace=monitoring")
    (cm,) = [c for c in of_kind(objs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(cm["data"]["pdserve.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "pdserve.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids)
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 20
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            _check_expr(expr)
    # the series every panel and alert is about exist on the workers and gateways; one panel per
    # family a worker or gateway exports, so a new metric reminds whoever adds it
    queried = {m for p in graphs for t in p["targets"] for m in _METRIC.findall(t["expr"])}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in queried}
    exported = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in _exported() if m.startswith("pdserve_")}
    unshown = (
        exported
        - families
        - {
            "pdserve_kv_transfer_seconds",  # the gRPC push's older histogram; the per-transport one is shown
            "pdserve_kv_transfer_bytes",
            "pdserve_kv_transfer_requests",
            "pdserve_kv_transfer_read_seconds",
            "pdserve_queue_time_seconds",
            "pdserve_rank_used_tokens",
            "pdserve_spec_decode_num_drafts",
            "pdserve_spec_decode_num_accepted_tokens_per_pos",
            "pdserve_spec_decode_step_cost_ms",
            "pdserve_schedule_decisions",
            "pdserve_engine_step_tokens",
        }
    )
    assert not unshown, f"no dashboard panel shows {sorted(unshown)}"
