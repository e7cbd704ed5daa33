"""benchmarks/bench_stack.py without starting a stack: the flags of a GPU run reach every worker
of the `pdserve up` each configuration starts (with up's own split of the GPU's memory), the CPU
defaults stay as they were, and the targets are judged at 2,048 tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_stack
from services import up, up_shape
from tests.support.stack import Stack, running_stack


class _Started(Exception):
    """Raised instead of starting `pdserve up`; carries its command line."""

    def __init__(self, cmd: list[str]) -> None:
        super().__init__("not started")
        self.cmd = cmd


def _workers_args(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any]
) -> dict[str, list[str]]:
    """Worker child name -> its argv, for the `pdserve up` that running_stack would run."""

    def fake_popen(cmd: list[str], **_: Any) -> None:
        raise _Started(cmd)

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    with pytest.raises(_Started) as started, running_stack("random-llama-8b", tmp_path, **config):
        pass
    cmd = started.value.cmd
    assert cmd[1:4] == ["-m", "services.cli", "up"]
    args = up._parse(cmd[4:])
    return {c.name: c.args for c in up_shape.children(args, "random-llama-8b") if "worker" in c.name}


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of the last `name VALUE` in argv (the one argparse keeps), None when absent."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else None


def test_cuda_flags_reach_every_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = bench_stack.parse_args(
        [
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--model",
            "random:llama-8b",
            "--lengths",
            "2048",
            "--reps",
            "2",
        ]
    )
    assert (a.kv_lengths, a.ttft_lengths, a.reps, a.parts) == ([2048], [2048], 2, ["a", "b"])
    configs = bench_stack.stack_configs(a, ["nixl", "grpc"])
    assert list(configs) == ["disaggregated_nixl", "disaggregated_grpc", "unified"]
    for name, config in configs.items():
        workers = _workers_args(monkeypatch, tmp_path, config)
        assert set(workers) == ({"worker"} if name == "unified" else {"prefill-worker", "decode-worker"})
        for argv in workers.values():
            assert (_flag(argv, "--device"), _flag(argv, "--dtype")) == ("cuda", "bfloat16")
            # two workers on one GPU: up halves its 0.9; the prefill worker captures no graphs
            shared = name != "unified"
            assert _flag(argv, "--gpu-memory-utilization") == ("0.45" if shared else None)
            assert ("--no-cuda-graphs" in argv) == (argv is workers.get("prefill-worker"))
            assert _flag(argv, "--kv-transport") == ("grpc" if name == "disaggregated_grpc" else None)


def test_cpu_defaults_and_result_files() -> None:
    a = bench_stack.parse_args([])
    assert (a.device, a.dtype, a.kv_lengths, a.ttft_lengths, a.reps) == (
        "cpu",
        "auto",
        [128, 512, 2048],
        [512, 2048],
        3,
    )
    assert a.parts == ["a", "b", "c"] and a.transports == ["nixl", "grpc"]
    assert bench_stack.out_path(a, "") == bench_stack.RESULTS / "stack.json"
    quick = bench_stack.parse_args(["--quick"])
    assert (quick.kv_lengths, quick.reps) == ([64, 256], 1)
    assert bench_stack.out_path(quick, "") == bench_stack.RESULTS / "stack-quick.json"
    cuda = bench_stack.parse_args(["--device", "cuda"])
    tag = bench_stack.gpu_tag("NVIDIA H200")
    assert bench_stack.out_path(cuda, tag) == bench_stack.RESULTS / "stack-cuda-h200.json"
    assert cuda.command == "python -m benchmarks.bench_stack --device cuda"
    with pytest.raises(SystemExit):
        bench_stack.parse_args(["--parts", "a,d"])
    with pytest.raises(SystemExit):
        bench_stack.parse_args(["--transports", "rdma"])


def test_targets_are_judged_at_2048_tokens() -> None:
    kv = [
        {"transport": "nixl", "prompt_tokens": 512, "transfer_over_prefill": 0.2},
        {"transport": "nixl", "prompt_tokens": 2048, "transfer_over_prefill": 0.01},
        {"transport": "grpc", "prompt_tokens": 2048, "transfer_over_prefill": 0.3},
    ]
    ttft = [{"prompt_tokens": 2048, "nixl_over_unified": 1.05, "grpc_over_unified": 1.4}]
    goals = bench_stack.targets(kv, ttft, ["nixl", "grpc"])
    assert [(g["target"], g["transport"], g["met"]) for g in goals] == [
        ("kv_transfer_over_prefill", "nixl", True),
        ("kv_transfer_over_prefill", "grpc", False),
        ("ttft_disaggregated_over_unified", "nixl", True),
        ("ttft_disaggregated_over_unified", "grpc", False),
    ]
    # NIXL asked, the gRPC push used: that stack's TTFT is not NIXL's, so it is judged on nothing
    kv[1] = {
        "transport": "nixl",
        "prompt_tokens": 2048,
        "error": "asked for nixl, the prefill worker used ...",
    }
    goals = bench_stack.targets(kv, ttft, ["nixl", "grpc"])
    assert [(g["target"], g["transport"]) for g in goals] == [
        ("kv_transfer_over_prefill", "grpc"),
        ("ttft_disaggregated_over_unified", "grpc"),
    ]


def test_cuda_stacks_run_one_after_another(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The GPU path's orchestration with the stacks and measurements faked: each stack stops before
    the next starts, (a) runs on the NIXL stack only, every stack's TTFT is kept, and one that does
    not start leaves the others' numbers in the result, with its error."""
    events: list[str] = []

    @contextlib.contextmanager
    def fake_stack(model: str, log_dir: Path, **config: Any) -> Iterator[Stack]:
        name = log_dir.name
        if name == "disaggregated_grpc":
            raise RuntimeError("stack did not come up in time")
        events.append(f"start {name}")
        yield Stack(
            gateway=f"gw-{name}",
            scheduler="",
            load_monitor="",
            prefill=None if config.get("unified") else "p",
            decode=None if config.get("unified") else "d",
            unified=None,
            port_base=0,
            log_dir=log_dir,
            output=[],
        )
        events.append(f"stop {name}")

    async def fake_kv(
        prefill: str, decode: str, lengths: list[int], reps: int, *_: Any
    ) -> list[dict[str, Any]]:
        events.append("kv")
        return [{"transport": "nixl", "prompt_tokens": 2048, "transfer_over_prefill": 0.01}]

    async def fake_ttft(
        gateways: dict[str, str],
        lengths: list[int],
        reps: int,
        metrics: dict[str, str] | None = None,
        phases: dict[str, dict[int, dict[str, float]]] | None = None,
        second: dict[str, dict[int, float]] | None = None,
    ) -> dict[str, dict[int, float]]:
        (name,) = gateways
        assert metrics is not None and set(metrics) == {name}  # its gateway's /metrics
        assert second is not None
        second[name] = {2048: 130.0}
        events.append(f"ttft {name}")
        return {name: {2048: 100.0 if name == "unified" else 105.0}}

    monkeypatch.setattr(bench_stack, "running_stack", fake_stack)
    monkeypatch.setattr(bench_stack, "kv_vs_prefill", fake_kv)
    monkeypatch.setattr(bench_stack, "ttft_ms", fake_ttft)
    monkeypatch.setattr(bench_stack, "resolve_model", lambda model: tmp_path)
    out = tmp_path / "stack-cuda.json"
    a = bench_stack.parse_args(["--device", "cuda", "--lengths", "2048", "--out", str(out)])
    run = bench_stack._Run(
        a=a, transports=["nixl", "grpc"], dtype="bfloat16", together=False, out=out, machine={"gpu": "x"}
    )
    doc = asyncio.run(bench_stack.main_async(a, run))
    assert events == [
        "start disaggregated_nixl",
        "kv",
        "ttft disaggregated_nixl",
        "stop disaggregated_nixl",
        "start unified",
        "ttft unified",
        "stop unified",
    ]
    assert doc["ttft"] == [
        {
            "prompt_tokens": 2048,
            "unified_ms": 100.0,
            "disaggregated_nixl_ms": 105.0,
            "nixl_over_unified": 1.05,
            "second_token_ms": {"disaggregated_nixl": 130.0, "unified": 130.0},
        }
    ]
    assert [(g["target"], g["met"]) for g in doc["targets"]] == [
        ("kv_transfer_over_prefill", True),
        ("ttft_disaggregated_over_unified", True),
    ]
    assert "did not come up" in doc["errors"]["disaggregated_grpc"]
    assert json.loads(out.read_text()) == doc and "partial" not in doc


def test_the_gateways_ttft_phases_are_read_and_reported_per_length() -> None:
    """bench_stack (b) splits each configuration's TTFT as its gateway did (schedule, admit,
    prefill: pdserve_time_to_first_token_phase_seconds), per prompt length."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    phases = Histogram("pdserve_time_to_first_token_phase_seconds", "", ["phase"], registry=reg)
    for phase, seconds in (("schedule", 0.002), ("admit", 0.003), ("prefill", 0.05), ("prefill", 0.07)):
        phases.labels(phase=phase).observe(seconds)
    totals = bench_stack.ttft_phase_totals(generate_latest(reg).decode())
    assert totals["prefill"] == pytest.approx((0.12, 2.0))
    assert totals["admit"] == pytest.approx((0.003, 1.0))
    split = {"disaggregated_nixl": {2048: {"schedule": 2.0, "admit": 3.0, "prefill": 60.0}}}
    rows = bench_stack.ttft_rows({"disaggregated_nixl": {2048: 65.0}}, [512, 2048], ["nixl"], split)
    assert "phases_ms" not in rows[0]
    assert rows[1]["phases_ms"] == {"disaggregated_nixl": {"schedule": 2.0, "admit": 3.0, "prefill": 60.0}}
