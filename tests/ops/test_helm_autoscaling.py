"""The chart's optional HorizontalPodAutoscalers: off by default; when on, one autoscaling/v2 HPA
per worker role on a metric pdserve really exports, and the Deployment leaves replicas to it."""

from __future__ import annotations

import pytest
from prometheus_client.metrics import MetricWrapperBase

from shared import metrics
from tests.ops.helm_render import (
    GPU_VALUES,
    WORKERS,
    Obj,
    RenderError,
    component,
    deployments,
    helm_binary,
    of_kind,
    render,
)

pytestmark = pytest.mark.skipif(
    helm_binary() is None, reason="helm is not installed: `make tools` installs it into .tools/bin"
)

ON = ("--set", "prefillWorker.autoscaling.enabled=true", "--set", "decodeWorker.autoscaling.enabled=true")


def hpas(objs: list[Obj]) -> dict[str, Obj]:
    return {component(h): h for h in of_kind(objs, "HorizontalPodAutoscaler")}


def exported_metric_names() -> set[str]:
    return {
        family.name
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
        for family in m.describe()
    }


def test_off_by_default_and_replicas_stay_with_the_deployment() -> None:
    for objs in (render(), render("-f", str(GPU_VALUES), "--set", "model.pvc.claimName=m")):
        assert hpas(objs) == {}
        for dep in deployments(objs).values():
            assert isinstance(dep["spec"]["replicas"], int)


@pytest.mark.parametrize("values", [(), ("-f", str(GPU_VALUES), "--set", "model.pvc.claimName=m")])
def test_one_hpa_per_worker_role_on_pdserve_metrics(values: tuple[str, ...]) -> None:
    objs = render(*values, *ON)
    found = hpas(objs)
    assert sorted(found) == sorted(WORKERS)
    deps = deployments(objs)
    exported = exported_metric_names()
    for name, hpa in found.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert target == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deps[name]["metadata"]["name"],
        }
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        # The HPA owns the replica count: a `helm upgrade` must not reset what it scaled to.
        assert "replicas" not in deps[name]["spec"]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] in exported, "the chart scales on a metric pdserve exports"
    # Prefill scales on its backlog, decode on KV memory.
    assert found["prefill-worker"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == (
        "pdserve_rank_waiting_prompt_tokens"
    )
    assert found["decode-worker"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == (
        "pdserve_kv_cache_usage_ratio"
    )
    # Only the workers are autoscaled.
    for name in ("gateway", "scheduler", "load-monitor"):
        assert isinstance(deps[name]["spec"]["replicas"], int)


def test_roles_scale_independently_with_their_own_bounds_and_behavior() -> None:
    objs = render(
        "--set",
        "decodeWorker.autoscaling.enabled=true",
        "--set",
        "decodeWorker.autoscaling.minReplicas=2",
        "--set",
        "decodeWorker.autoscaling.maxReplicas=16",
        "--set",
        "decodeWorker.autoscaling.metrics[0].type=Pods",
        "--set",
        "decodeWorker.autoscaling.metrics[0].pods.metric.name=pdserve_rank_running_requests",
        "--set",
        "decodeWorker.autoscaling.metrics[0].pods.target.type=AverageValue",
        "--set-string",
        "decodeWorker.autoscaling.metrics[0].pods.target.averageValue=48",
        "--set",
        "decodeWorker.autoscaling.behavior.scaleDown.stabilizationWindowSeconds=600",
    )
    found = hpas(objs)
    assert sorted(found) == ["decode-worker"]
    spec = found["decode-worker"]["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 16)
    assert spec["metrics"][0]["pods"]["metric"]["name"] == "pdserve_rank_running_requests"
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}
    deps = deployments(objs)
    assert "replicas" not in deps["decode-worker"]["spec"]
    assert deps["prefill-worker"]["spec"]["replicas"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "prefillWorker.autoscaling.minReplicas=5"), "minReplicas must not exceed maxReplicas"),
        (("--set", "metrics.enabled=false"), "needs metrics.enabled"),
        (("--set", "decodeWorker.autoscaling.maxReplica=3"), "Additional property maxReplica"),
        (("--set", "decodeWorker.autoscaling.minReplicas=0"), "minReplicas"),
    ],
)
def test_inconsistent_autoscaling_values_fail_to_render(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render(*ON, *args)
