"""benchmarks/host_overhead.py on a tiny model: every phase of the decode steps that ran all N
requests is timed (with and without async scheduling), and the step loop is left unpatched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import host_overhead
from services.worker.engine import rank, scheduler
from tests.support.tiny_models import build_tiny_model


@pytest.mark.parametrize("overlap", [False, True])
def test_host_overhead_times_every_phase_of_full_decode_steps(tmp_path: Path, overlap: bool) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    out = tmp_path / "host.json"
    step, update = rank.Rank._step, scheduler.Scheduler.update
    args = ["--model", str(model), "--concurrency", "1", "3", "--prompt-tokens", "8", "--new-tokens", "6"]
    args += ["--repeats", "1", "--out", str(out), *(["--async-scheduling"] if overlap else [])]
    host_overhead.main(args)
    assert rank.Rank._step is step and scheduler.Scheduler.update is update  # restored
    doc = json.loads(out.read_text())
    assert doc["workload"]["async_scheduling"] is overlap and doc["machine"]["class"].startswith("cpu-")
    assert [r["concurrency"] for r in doc["results"]] == [1, 3]
    for row in doc["results"]:
        for phase in ("schedule", "inputs", "forward", "sample", "update", "outputs"):
            assert row[f"{phase}_ms"] > 0, (row["concurrency"], phase)
        assert 0 < row["host_ms"] < row["step_ms"]
