"""Smoke test of the goodput benchmark: the harness starts a real stack with `pdserve up` (tiny
model), measures quiet runs, derives SLOs and drives a few streamed requests at one rate through
the OpenAI-compatible HTTP API. It checks that the harness works, never how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import ROOT, free_port_base

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_goodput_harness_drives_a_real_stack_over_http(tiny_bpe_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    cmd = [
        sys.executable, "-m", "benchmarks.bench_goodput", "--quick",
        "--model", str(tiny_bpe_model), "--configs", "disaggregated", "--workloads", "chat",
        "--warmup-requests", "1", "--quiet-requests", "2", "--rates", "4",
        "--min-requests", "4", "--max-requests", "4", "--quick-max-tokens", "8",
        "--port-base", str(free_port_base()), "--out", str(out), "--no-plots",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "services.cli up" in proc.stdout and "--prefill-workers 1 --decode-workers 1" in proc.stdout
    assert "SLO TTFT = 4 x" in proc.stdout

    doc = json.loads(out.read_text())
    [point] = doc["runs"]["chat"]["disaggregated"]
    assert point["rate_rps"] == 4.0
    assert point["requests"] == 4 and point["ok"] == 4 and point["errors"] == {}
    assert point["completion_tokens_mean"] == 8.0  # ignore_eos: every request runs to max_tokens
    assert point["prompt_tokens_mean"] >= 100  # from usage: the drawn message length + template
    assert point["ttft_p90_ms"] > 0 and point["itl_p50_ms"] > 0 and point["tpot_p50_ms"] > 0
    assert 0.0 <= point["attainment"] <= 1.0
    slo = doc["slo"]["chat"]
    assert slo["ttft_ms"] > 0 and slo["tpot_ms"] > 0 and slo["quiet"]["disaggregated"]["ok"] == 2
    assert doc["goodput_rps"]["chat"]["disaggregated"] in (0.0, 4.0)
    assert "services.cli up" in doc["commands"]["disaggregated"]
    assert doc["machine"]["torch"]
