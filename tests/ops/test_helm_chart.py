"""The Helm chart rendered with the default (CPU) and the GPU values: the objects an operator
relies on exist and are wired as the services expect (ports, env settings, probes, drain grace)."""

from __future__ import annotations

import dataclasses
import importlib
import math
from pathlib import Path
from typing import Any

import pytest

from tests.ops.helm_render import (
    COMPONENTS,
    GPU_VALUES,
    HEALTH_SERVICES,
    WORKERS,
    Obj,
    RenderError,
    component,
    container,
    deployments,
    env_names_in_order,
    env_of,
    helm_binary,
    of_kind,
    render,
)

pytestmark = pytest.mark.skipif(
    helm_binary() is None, reason="helm is not installed: `make tools` installs it into .tools/bin"
)

PORTS = {
    "gateway": 50051,
    "scheduler": 50052,
    "load-monitor": 50053,
    "prefill-worker": 50061,
    "decode-worker": 50071,
}
HTTP_PORT = 8000
METRICS_PORTS = {
    "gateway": 9100,
    "scheduler": 9101,
    "load-monitor": 9102,
    "prefill-worker": 9103,
    "decode-worker": 9104,
}


@pytest.fixture(scope="module")
def default_objs() -> list[Obj]:
    return render()


@pytest.fixture(scope="module")
def gpu_objs() -> list[Obj]:
    return render("-f", str(GPU_VALUES), "--set", "model.pvc.claimName=models", "--set", "model.path=m1")


@pytest.fixture(params=["default", "gpu"])
def objs(request: pytest.FixtureRequest, default_objs: list[Obj], gpu_objs: list[Obj]) -> list[Obj]:
    return default_objs if request.param == "default" else gpu_objs


def gpus(deployment: Obj) -> tuple[Any, Any]:
    res = container(deployment).get("resources", {})
    return res.get("requests", {}).get("nvidia.com/gpu"), res.get("limits", {}).get("nvidia.com/gpu")


def test_one_deployment_and_service_per_service(objs: list[Obj]) -> None:
    deps = deployments(objs)
    assert sorted(deps) == sorted(COMPONENTS)
    services = {component(s): s for s in of_kind(objs, "Service")}
    assert sorted(services) == sorted(COMPONENTS)
    for name, dep in deps.items():
        c = container(dep)
        assert c["command"] == ["pdserve", name]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        http = {"http": HTTP_PORT} if name == "gateway" else {}  # the OpenAI-compatible API
        assert ports == {"grpc": PORTS[name], "metrics": METRICS_PORTS[name], **http}
        svc_ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert svc_ports == {"grpc": PORTS[name], "metrics": METRICS_PORTS[name], **http}
        # The Service selects exactly this Deployment's pods.
        assert services[name]["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # Workers are called per pod at their advertised address: headless Services.
    for name in WORKERS:
        assert services[name]["spec"]["clusterIP"] == "None"
    assert services["gateway"]["spec"]["type"] == "ClusterIP"


def test_native_grpc_probes(objs: list[Obj]) -> None:
    for name, dep in deployments(objs).items():
        c = container(dep)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == PORTS[name], (name, probe)
        # Readiness and startup follow the service's own health (NOT_SERVING until the model is
        # loaded / while draining); liveness the overall server health.
        assert c["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICES[name]
        assert c["startupProbe"]["grpc"]["service"] == HEALTH_SERVICES[name]
        assert c["livenessProbe"]["grpc"]["service"] == ""
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room for slow model loads"


def test_termination_grace_exceeds_drain_grace(objs: list[Obj]) -> None:
    for name, dep in deployments(objs).items():
        drain = float(env_of(dep)["PDSERVE_DRAIN_GRACE_S"])
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        sleep = container(dep).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert grace > drain + sleep, name


def test_termination_grace_follows_a_fractional_drain_grace() -> None:
    objs = render("--set", "common.drainGraceS=90.5", "--set", "common.terminationGraceExtraS=5")
    for dep in deployments(objs).values():
        assert env_of(dep)["PDSERVE_DRAIN_GRACE_S"] == "90.5"
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == math.ceil(90.5) + 5


def test_gpu_requests_only_on_workers(default_objs: list[Obj], gpu_objs: list[Obj]) -> None:
    for dep in deployments(default_objs).values():
        assert gpus(dep) == (None, None)
    for name, dep in deployments(gpu_objs).items():
        if name in WORKERS:
            assert gpus(dep) == (1, 1), name
            env = env_of(dep)
            assert env["PDSERVE_DEVICE"] == "cuda"
            assert env["PDSERVE_DTYPE"] == "bfloat16"
            assert env["PDSERVE_BLOCK_SIZE"] == "32"  # GPU attention's tile is one block
            # prefill workers run prompt chunks only: no decode graphs to capture
            assert env.get("PDSERVE_CUDA_GRAPHS") == ("false" if name == "prefill-worker" else None)
            spec = dep["spec"]["template"]["spec"]
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            assert toleration in spec["tolerations"]
            # Replacing a GPU pod must not need a spare GPU.
            assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        else:
            assert gpus(dep) == (None, None), name
            assert "tolerations" not in dep["spec"]["template"]["spec"]
    assert env_of(deployments(gpu_objs)["gateway"])["PDSERVE_BLOCK_SIZE"] == "32"


def test_worker_roles_are_placed_independently() -> None:
    objs = render(
        "--set",
        "prefillWorker.nodeSelector.pool=prefill",
        "--set",
        "decodeWorker.nodeSelector.pool=decode",
        "--set",
        "prefillWorker.replicas=3",
        "--set",
        "decodeWorker.replicas=5",
        "--set",
        "decodeWorker.gpus=2",
    )
    deps = deployments(objs)
    assert deps["prefill-worker"]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "prefill"}
    assert deps["decode-worker"]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "decode"}
    assert deps["prefill-worker"]["spec"]["replicas"] == 3
    assert deps["decode-worker"]["spec"]["replicas"] == 5
    assert gpus(deps["decode-worker"]) == (2, 2)
    assert gpus(deps["prefill-worker"]) == (None, None)


def test_wiring_env(default_objs: list[Obj]) -> None:
    deps = deployments(default_objs)
    for name, dep in deps.items():
        env = env_of(dep)
        assert env["PDSERVE_LISTEN"] == f"0.0.0.0:{PORTS[name]}"
        assert env["PDSERVE_METRICS_PORT"] == str(METRICS_PORTS[name])
        assert env["PDSERVE_LOG_FORMAT"] == "json"
    assert env_of(deps["gateway"])["PDSERVE_SCHEDULER_ADDRESS"] == "pdserve-scheduler:50052"
    for name in ("scheduler", *WORKERS):
        assert env_of(deps[name])["PDSERVE_LOAD_MONITOR_ADDRESS"] == "pdserve-load-monitor:50053"
    for name in ("gateway", *WORKERS):
        assert env_of(deps[name])["PDSERVE_MODEL"] == "default"
        assert env_of(deps[name])["PDSERVE_LOG_PROMPTS"] == "false"
    for name in WORKERS:
        env = env_of(deps[name])
        names = env_names_in_order(deps[name])
        # Advertise the pod IP (downward API); POD_IP must be defined before it is referenced.
        assert env["POD_IP"] == "<valueFrom>"
        assert env["PDSERVE_ADVERTISE_ADDRESS"] == f"$(POD_IP):{PORTS[name]}"
        assert names.index("POD_IP") < names.index("PDSERVE_ADVERTISE_ADDRESS")
        pod_ip = next(e for e in container(deps[name])["env"] if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The gateway hashes prompt blocks with the workers' block size.
    block_size = env_of(deps["decode-worker"])["PDSERVE_BLOCK_SIZE"]
    assert env_of(deps["gateway"])["PDSERVE_BLOCK_SIZE"] == block_size


def test_settings_maps_become_env_vars() -> None:
    objs = render(
        "--set",
        "decodeWorker.settings.max_num_seqs=128",
        "--set",
        "decodeWorker.settings.kv_cache_tokens=1048576",
        "--set",
        "gateway.settings.log_level=debug",
        "--set",
        "prefillWorker.kvCacheTokens=65536",
        "--set",
        "loadMonitor.leaseTtlS=7.5",
    )
    deps = deployments(objs)
    dec = env_of(deps["decode-worker"])
    assert dec["PDSERVE_MAX_NUM_SEQS"] == "128"
    assert dec["PDSERVE_KV_CACHE_TOKENS"] == "1048576"  # no exponent notation
    assert env_of(deps["gateway"])["PDSERVE_LOG_LEVEL"] == "debug"  # the settings map wins
    assert env_of(deps["prefill-worker"])["PDSERVE_KV_CACHE_TOKENS"] == "65536"
    assert env_of(deps["load-monitor"])["PDSERVE_LEASE_TTL_S"] == "7.5"
    for dep in deps.values():
        names = env_names_in_order(dep)
        assert len(names) == len(set(names)), "duplicate env vars"


def test_model_sources(gpu_objs: list[Obj]) -> None:
    # PVC (GPU values): mounted read-only, PDSERVE_MODEL points into it, on workers and gateway.
    deps = deployments(gpu_objs)
    for name in ("gateway", *WORKERS):
        spec = deps[name]["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        mounts = {m["name"]: m for m in container(deps[name])["volumeMounts"]}
        assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
        assert env_of(deps[name])["PDSERVE_MODEL"] == "/models/m1"
    for name in ("scheduler", "load-monitor"):
        assert "PDSERVE_MODEL" not in env_of(deps[name])
    # hostPath
    deps = deployments(render("--set", "model.source=hostPath", "--set", "model.hostPath.path=/data/llm"))
    vols = {v["name"]: v for v in deps["decode-worker"]["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["hostPath"] == {"path": "/data/llm", "type": "Directory"}
    assert env_of(deps["decode-worker"])["PDSERVE_MODEL"] == "/models"
    # A folder inside the image: no volume.
    deps = deployments(render("--set", "model.path=/opt/models/llama"))
    names = {v["name"] for v in deps["decode-worker"]["spec"]["template"]["spec"]["volumes"]}
    assert "model" not in names
    assert env_of(deps["decode-worker"])["PDSERVE_MODEL"] == "/opt/models/llama"


def test_lora_modules_reach_every_worker_from_the_model_volume(tmp_path: Path) -> None:
    """PDSERVE_LORA_MODULES on both worker roles (an adapter's prefill and decode both need it),
    not on the gateway; paths in the model's volume (pvc / hostPath) or the image."""
    values = tmp_path / "lora.yaml"
    values.write_text(
        "model:\n  loraModules:\n    - {name: sql-lora, path: adapters/sql}\n"
        "    - {name: org/chat, path: /adapters/chat/}\n"
    )
    deps = deployments(
        render("-f", str(values), "--set", "model.source=pvc", "--set", "model.pvc.claimName=m")
    )
    for name in WORKERS:
        assert env_of(deps[name])["PDSERVE_LORA_MODULES"] == (
            "sql-lora=/models/adapters/sql,org/chat=/models/adapters/chat"
        )
    for name in ("gateway", "scheduler", "load-monitor"):
        assert "PDSERVE_LORA_MODULES" not in env_of(deps[name])
    deps = deployments(render("-f", str(values)))  # source: image
    assert (
        env_of(deps["decode-worker"])["PDSERVE_LORA_MODULES"]
        == "sql-lora=adapters/sql,org/chat=/adapters/chat/"
    )
    assert "PDSERVE_LORA_MODULES" not in env_of(deployments(render())["decode-worker"])
    # what the worker reads, the way it reads it
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    env = {"PDSERVE_LORA_MODULES": "sql-lora=/models/adapters/sql,org/chat=/models/adapters/chat"}
    assert parse_settings(WorkerSettings, [], env=env).lora_adapters == ("sql-lora", "org/chat")


def test_fp8_weights_are_set_on_every_worker_alike() -> None:
    """model.quantization becomes PDSERVE_QUANTIZATION of every worker (prefill and decode must
    compute with the same weights), read the way the workers read it; unset by default."""
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    for name in WORKERS:
        assert "PDSERVE_QUANTIZATION" not in env_of(deployments(render())[name])
    deps = deployments(render("--set", "model.quantization=fp8"))
    for name in WORKERS:
        assert parse_settings(WorkerSettings, [], env=env_of(deps[name])).quantization == "fp8"
    for name in ("gateway", "scheduler", "load-monitor"):
        assert "PDSERVE_QUANTIZATION" not in env_of(deps[name])


def test_runtime_lora_updating_is_off_unless_asked_for() -> None:
    """gateway.allowRuntimeLoraUpdating becomes the gateway's PDSERVE_ALLOW_RUNTIME_LORA_UPDATING
    (false by default), model.enableLora every worker's PDSERVE_ENABLE_LORA (both halves of an
    adapter's request need it), read the way the services read them."""
    from services.gateway.settings import GatewaySettings
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    deps = deployments(render())
    assert env_of(deps["gateway"])["PDSERVE_ALLOW_RUNTIME_LORA_UPDATING"] == "false"
    for name in WORKERS:
        assert "PDSERVE_ENABLE_LORA" not in env_of(deps[name])
    deps = deployments(
        render("--set", "gateway.allowRuntimeLoraUpdating=true", "--set", "model.enableLora=true")
    )
    gateway = env_of(deps["gateway"])
    assert parse_settings(GatewaySettings, [], env=gateway).allow_runtime_lora_updating
    assert "PDSERVE_ENABLE_LORA" not in gateway
    for name in WORKERS:
        assert parse_settings(WorkerSettings, [], env=env_of(deps[name])).lora_enabled
    for name in ("scheduler", "load-monitor"):
        assert not {"PDSERVE_ENABLE_LORA", "PDSERVE_ALLOW_RUNTIME_LORA_UPDATING"} & set(env_of(deps[name]))


@pytest.mark.parametrize(
    ("folder", "var", "field"),
    [("batches", "PDSERVE_BATCH_DIR", "batch_dir"), ("responses", "PDSERVE_RESPONSE_DIR", "response_dir")],
)
def test_the_gateways_get_their_shared_folders(folder: str, var: str, field: str) -> None:
    """gateway.batches (the Batch API) and gateway.responses (stored responses): the folder's
    setting on the gateway only, over an emptyDir or the PVC every replica mounts (several
    replicas without one fail to render, in the inconsistent-values test); each on its own."""
    from services.gateway.settings import GatewaySettings
    from shared.settings import parse_settings

    assert var not in env_of(deployments(render())["gateway"])  # off by default
    for extra, volume in (
        ([], "emptyDir"),
        (
            ["--set", f"gateway.{folder}.claimName=shared", "--set", "gateway.replicas=3"],
            "persistentVolumeClaim",
        ),
    ):
        deps = deployments(render("--set", f"gateway.{folder}.enabled=true", *extra))
        gateway = deps["gateway"]
        settings = parse_settings(GatewaySettings, [], env=env_of(gateway))
        mounts = {m["name"]: m["mountPath"] for m in container(gateway)["volumeMounts"]}
        assert getattr(settings, field) == mounts[folder] == f"/var/lib/pdserve/{folder}"
        volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
        assert volume in volumes[folder]
        assert {"batches", "responses"} - {folder} - set(volumes)  # the other one stays off
        for name in ("scheduler", *WORKERS):
            assert var not in env_of(deps[name])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "model.source=pvc"], "model.pvc.claimName is required"),
        (
            ["--set", "gateway.batches.enabled=true", "--set", "gateway.replicas=2"],
            "needs gateway.batches.claimName",
        ),
        (
            ["--set", "gateway.responses.enabled=true", "--set", "gateway.replicas=2"],
            "needs gateway.responses.claimName",
        ),
        (["--set", "model.source=s3"], "model.source must be"),
        (["--set", "decodeWorker.blockSize=32"], "blockSize must match"),
        (["--set", "tls.enabled=true"], "tls.secretName is required"),
        # values.schema.json: a typo or a wrong value fails instead of being silently ignored
        (["--set", "prefillWorker.gpu=1"], "Additional property gpu is not allowed"),
        (["--set", "decodeWorker.device=tpu"], "must be one of"),
        (["--set", "common.drainGraceS=-1"], "drainGraceS"),
        (["--set", "model.loraModules[0].name=sql"], "path is required"),
        (["--set", "model.enableLora=yes"], "enableLora"),
        (["--set", "model.quantization=int4"], "quantization"),
        (["--set", "model.loraModules[0].name=-x", "--set", "model.loraModules[0].path=a"], "pattern"),
        (
            [
                *("--set", "model.loraModules[0].name=sql", "--set", "model.loraModules[0].path=a"),
                *("--set", "model.loraModules[1].name=sql", "--set", "model.loraModules[1].path=b"),
            ],
            'the name "sql" is given twice',
        ),
    ],
)
def test_inconsistent_values_fail_to_render(args: list[str], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render(*args)


def test_pod_disruption_budgets(objs: list[Obj]) -> None:
    pdbs = {component(p): p for p in of_kind(objs, "PodDisruptionBudget")}
    deps = deployments(objs)
    assert sorted(pdbs) == sorted(COMPONENTS)
    for name, pdb in pdbs.items():
        assert pdb["spec"]["selector"]["matchLabels"] == deps[name]["spec"]["selector"]["matchLabels"]
        assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


def test_network_policy_exposes_only_the_gateway(objs: list[Obj]) -> None:
    policies = {p["metadata"]["name"]: p for p in of_kind(objs, "NetworkPolicy")}
    assert sorted(policies) == ["pdserve-gateway", "pdserve-internal"]
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "pdserve"}
    internal = policies["pdserve-internal"]["spec"]
    # Every pod of the release: ingress only from the release's own pods.
    assert internal["podSelector"] == {"matchLabels": release}
    assert internal["policyTypes"] == ["Ingress"]
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    gateway = policies["pdserve-gateway"]["spec"]
    assert gateway["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    # Only the gateway's gRPC and HTTP ports are open to clients outside the release.
    assert gateway["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": HTTP_PORT}]}
    ]


def test_network_policy_metrics_and_client_peers() -> None:
    objs = render(
        "--set",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
        "--set",
        "networkPolicy.gatewayFrom[0].ipBlock.cidr=10.0.0.0/8",
    )
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(objs, "NetworkPolicy")}
    metrics_rule = policies["pdserve-internal"]["ingress"][1]
    assert sorted(p["port"] for p in metrics_rule["ports"]) == sorted(METRICS_PORTS.values())
    assert policies["pdserve-gateway"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert of_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []


def test_gateway_http_port_and_api_keys_from_a_secret(default_objs: list[Obj]) -> None:
    gw = deployments(default_objs)["gateway"]
    assert env_of(gw)["PDSERVE_HTTP_PORT"] == str(HTTP_PORT)
    assert "PDSERVE_API_KEY_FILE" not in env_of(gw)  # keys are off by default
    for name, dep in deployments(default_objs).items():
        assert ("PDSERVE_HTTP_PORT" in env_of(dep)) == (name == "gateway")
    # httpPort 0: no HTTP port anywhere, the gateway is told -1 (off)
    off = render("--set", "gateway.httpPort=0")
    gw = deployments(off)["gateway"]
    assert env_of(gw)["PDSERVE_HTTP_PORT"] == "-1"
    assert "http" not in {p["name"] for p in container(gw)["ports"]}
    svc = {component(s): s for s in of_kind(off, "Service")}["gateway"]
    assert "http" not in {p["name"] for p in svc["spec"]["ports"]}
    policy = {p["metadata"]["name"]: p["spec"] for p in of_kind(off, "NetworkPolicy")}["pdserve-gateway"]
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 50051}]}]
    # API keys: an existing Secret, mounted read-only; the gateway reads the file
    keyed = render("--set", "gateway.apiKeys.enabled=true", "--set", "gateway.apiKeys.secretName=my-keys")
    gw = deployments(keyed)["gateway"]
    assert env_of(gw)["PDSERVE_API_KEY_FILE"] == "/etc/pdserve/api-keys/api-keys"
    assert "PDSERVE_API_KEYS" not in env_of(gw)  # never a plain env value
    mount = next(m for m in container(gw)["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/pdserve/api-keys", "readOnly": True}
    volume = next(v for v in gw["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "my-keys"
    assert volume["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    for name, dep in deployments(keyed).items():
        if name != "gateway":
            assert "api-keys" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    with pytest.raises(RenderError, match="secretName is required"):
        render("--set", "gateway.apiKeys.enabled=true")
    with pytest.raises(RenderError):
        render("--set", "gateway.httpPort=70000")  # values.schema.json


def test_service_monitor_is_optional(default_objs: list[Obj]) -> None:
    assert of_kind(default_objs, "ServiceMonitor") == []
    (sm,) = of_kind(render("--set", "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    no_metrics = render("--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true")
    assert of_kind(no_metrics, "ServiceMonitor") == []
    for name, dep in deployments(no_metrics).items():
        assert env_of(dep)["PDSERVE_METRICS_PORT"] == "-1"
        http = ["http"] if name == "gateway" else []
        assert [p["name"] for p in container(dep)["ports"]] == ["grpc", *http]


def test_tls_secret_mounted_and_probes_use_tls() -> None:
    objs = render("--set", "tls.enabled=true", "--set", "tls.secretName=pdserve-tls")
    for name, dep in deployments(objs).items():
        spec = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "pdserve-tls"
        env = env_of(dep)
        assert env["PDSERVE_TLS_CERT_FILE"] == "/etc/pdserve/tls/tls.crt"
        assert "PDSERVE_TLS_CLIENT_AUTH" not in env  # one-way TLS unless tls.mutual
        # The kubelet's gRPC probe speaks plaintext: with TLS an in-container health check runs.
        probe = container(dep)["readinessProbe"]
        assert "grpc" not in probe
        script = probe["exec"]["command"][-1]
        compile(script, "probe", "exec")  # valid Python
        assert f"127.0.0.1:{PORTS[name]}" in script and HEALTH_SERVICES[name] in script


def test_cluster_token_comes_from_a_secret(default_objs: list[Obj]) -> None:
    for dep in deployments(default_objs).values():
        assert "PDSERVE_CLUSTER_TOKEN" not in env_of(dep)  # off unless a secret is named
    objs = render("--set", "clusterToken.secretName=pdserve-cluster")
    for name, dep in deployments(objs).items():
        (entry,) = [e for e in container(dep)["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"]
        assert entry["valueFrom"]["secretKeyRef"] == {"name": "pdserve-cluster", "key": "token"}, name
        assert "value" not in entry  # never a literal in the manifest


def test_hardened_pods(default_objs: list[Obj]) -> None:
    for dep in deployments(default_objs).values():
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        sc = container(dep)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        # Writable places exist for what the services write (HOME, the model cache).
        mounts = {m["mountPath"] for m in container(dep)["volumeMounts"]}
        assert "/tmp" in mounts
        if "PDSERVE_MODEL_CACHE_DIR" in env_of(dep):
            assert env_of(dep)["PDSERVE_MODEL_CACHE_DIR"] in mounts


# The chart's env vars must be settings the services really have (unknown PDSERVE_* variables are
# silently ignored, so a typo would go unnoticed). Checked for each service whose settings exist.
SETTINGS_MODULES = {
    "gateway": "services.gateway.settings",
    "scheduler": "services.scheduler.settings",
    "load-monitor": "services.load_monitor.settings",
    "prefill-worker": "services.worker.settings",
    "decode-worker": "services.worker.settings",
}
# Set by the chart only when tls.enabled; the services do not read them yet.


def settings_fields(module_name: str) -> set[str] | None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    for value in vars(module).values():
        if dataclasses.is_dataclass(value) and isinstance(value, type):
            names = {f.name for f in dataclasses.fields(value)}
            if "listen" in names:
                return names
    return None


@pytest.mark.parametrize("name", COMPONENTS)
def test_env_vars_are_real_settings(name: str, default_objs: list[Obj], gpu_objs: list[Obj]) -> None:
    fields = settings_fields(SETTINGS_MODULES[name])
    if fields is None:
        pytest.skip(f"{SETTINGS_MODULES[name]} has no settings dataclass yet")
    mtls_objs = render(
        "--set",
        "tls.enabled=true",
        "--set",
        "tls.secretName=s",
        "--set",
        "tls.mutual=true",
        "--set",
        "tls.serverName=pdserve.internal",
    )
    for objs in (default_objs, gpu_objs, mtls_objs):
        env = env_of(deployments(objs)[name])
        chart_settings = {k.removeprefix("PDSERVE_").lower() for k in env if k.startswith("PDSERVE_")}
        unknown = chart_settings - fields
        assert not unknown, f"{name}: the chart sets PDSERVE_* vars the service does not read: {unknown}"
