"""Runs the Node example client (examples/node/client.js) and parses what it prints.

Used by tests/ops (against an in-process fake gateway) and by tests that run it against a real
stack: `run_node_client(address, "--prompt", "hi")`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "node"
CLIENT = EXAMPLE / "client.js"


@dataclass
class NodeRun:
    returncode: int
    stdout: str
    stderr: str
    # One parsed JSON summary per call, in order ({"rpc": "Generate", ...}, {"rpc": "Complete", ...}).
    summaries: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, rpc: str) -> dict[str, Any]:
        (found,) = [s for s in self.summaries if s.get("rpc") == rpc]
        return found


def node_client_missing() -> str | None:
    """Why the client cannot run here (None when it can)."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return "examples/node dependencies are not installed (run `make tools`)"
    return None


def run_node_client(address: str, *args: str, timeout_s: float = 120.0) -> NodeRun:
    """`node examples/node/client.js --address ADDRESS ARGS...`; summaries are its JSON lines."""
    proc = subprocess.run(
        ["node", str(CLIENT), "--address", address, *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout_s,
        cwd=ROOT,
    )
    summaries = []
    for line in proc.stdout.splitlines():
        if line.startswith('{"rpc":'):
            summaries.append(json.loads(line))
    return NodeRun(proc.returncode, proc.stdout, proc.stderr, summaries)
