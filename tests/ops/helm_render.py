"""Renders the Helm chart (helm template) into Python objects for the ops tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
GPU_VALUES = CHART / "values-gpu.yaml"
KUBE_VERSION = "1.31.0"

COMPONENTS = ("gateway", "scheduler", "load-monitor", "prefill-worker", "decode-worker")
WORKERS = ("prefill-worker", "decode-worker")
HEALTH_SERVICES = {
    "gateway": "pdserve.v1.Gateway",
    "scheduler": "pdserve.v1.Scheduler",
    "load-monitor": "pdserve.v1.LoadMonitor",
    "prefill-worker": "pdserve.v1.Worker",
    "decode-worker": "pdserve.v1.Worker",
}

Obj = dict[str, Any]


def helm_binary() -> str | None:
    """helm from `make tools` (.tools/bin/helm), else from PATH."""
    local = ROOT / ".tools" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("helm")


class RenderError(Exception):
    pass


def render(*args: str, release: str = "pdserve") -> list[Obj]:
    """`helm template RELEASE helm/pdserve ARGS...` -> the list of rendered objects."""
    helm = helm_binary()
    assert helm is not None, "helm is not installed (run `make tools`)"
    proc = subprocess.run(
        [helm, "template", release, str(CHART), "--kube-version", KUBE_VERSION, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RenderError(proc.stderr)
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def component(obj: Obj) -> str:
    return str(obj["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def deployments(objs: list[Obj]) -> dict[str, Obj]:
    return {component(d): d for d in of_kind(objs, "Deployment")}


def container(deployment: Obj) -> Obj:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def env_of(deployment: Obj) -> dict[str, str]:
    """Literal env values (valueFrom entries map to '<valueFrom>')."""
    out: dict[str, str] = {}
    for e in container(deployment).get("env", []):
        out[e["name"]] = e.get("value", "<valueFrom>")
    return out


def env_names_in_order(deployment: Obj) -> list[str]:
    return [e["name"] for e in container(deployment).get("env", [])]
