"""Chaos over real processes (tiny models, few requests): the stack's processes and KV survive,
or go away, as an operator expects when something is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.stack import ROOT, free_port_base

pytestmark = pytest.mark.e2e


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_sigkill_of_pdserve_up_takes_every_service_down(tiny_bpe_model: Path, tmp_path: Path) -> None:
    base = free_port_base()
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_bpe_model), "--port-base",
         str(base), "--log-dir", str(tmp_path), "--torch-threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    children: list[int] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("pdserve is up"):
                break
        else:
            pytest.fail(f"pdserve up exited ({up.wait()}) before it was up")
        children = _children_of(up.pid)
        assert len(children) == 5, children
        up.send_signal(signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        alive = [p for p in children if _alive(p)]
        assert not alive, f"services outlived a SIGKILLed pdserve up: {alive}"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()
            up.wait()
