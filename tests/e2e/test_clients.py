"""Clients an operator or a developer in another language uses, against the real stack:
the Node example (stubs loaded from protos/ at run time) and the README's grpcurl recipes, verbatim."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.grpcurl_recipes import recipe_argv, recipes
from tests.ops.node_client import node_client_missing, run_node_client
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def test_node_client_generate_and_complete(disagg_stack: Stack) -> None:
    missing = node_client_missing()
    if missing:
        pytest.skip(missing)
    run = run_node_client(
        disagg_stack.gateway,
        "--prompt",
        "The sky is blue because",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--rpc",
        "both",
    )
    assert run.returncode == 0, run.stderr
    gen, comp = run.summary("Generate"), run.summary("Complete")
    assert gen["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert gen["usage"] == comp["usage"]
    assert gen["text"] == comp["text"]
    assert 1 <= gen["usage"]["completion_tokens"] <= 8


def test_readme_grpcurl_recipes_run_verbatim(disagg_stack: Stack) -> None:
    base = disagg_stack.port_base
    addresses = {
        f"127.0.0.1:{port}": f"127.0.0.1:{base + offset}"
        for port, offset in ((50051, 0), (50052, 1), (50053, 2), (50061, 10), (50071, 20))
    }
    # the README's internal recipes name the token they tell the reader to start the stack with
    header = "x-pdserve-cluster-token: "
    addresses[header + "my-cluster-token"] = header + disagg_stack.cluster_token
    # The LoRA update recipes name the reader's adapter folder and need a gateway started with
    # --allow-runtime-lora-updating: tests/ops/test_grpcurl_recipes.py runs them against a fake
    # gateway, tests/integration/stack/test_lora.py the RPCs themselves on a real stack.
    commands = [c for c in recipes() if "LoraAdapter" not in c]
    assert len(commands) >= 10
    for command in commands:
        proc = subprocess.run(
            recipe_argv(command, grpcurl=GRPCURL, addresses=addresses),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr}"
        assert proc.stdout.strip(), command
