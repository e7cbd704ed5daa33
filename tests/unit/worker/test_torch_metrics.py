"""torch's figures of a worker (services/worker/torch_metrics.py): the allocator's counts become
counter increments counted once, its byte figures gauges, per GPU the KV pools live on (a worker
whose pools are on the CPU reads no GPU); every frame torch.compile compiles is counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from services.worker.torch_metrics import TorchMetrics, compiled_frames


class _Pool:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)  # all the figures read of a pool


class _Pools:
    """An engine's KV pools, one per rank, on these devices."""

    def __init__(self, *devices: str) -> None:
        self.devices = devices

    def kv_pools(self) -> list[Any]:
        return [_Pool(d) for d in self.devices]


def _value(name: str, device: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"device": device})


def test_allocator_counts_are_exported_once_and_bytes_as_gauges() -> None:
    stats = {
        torch.device("cuda:6"): {
            "allocated_bytes.all.current": 100,
            "reserved_bytes.all.current": 300,
            "num_alloc_retries": 2,
            "num_ooms": 0,
        }
    }
    retries = _value("pdserve_gpu_alloc_retries_total", "cuda:6") or 0.0
    ooms = _value("pdserve_gpu_ooms_total", "cuda:6") or 0.0
    exported = TorchMetrics(_Pools("cuda:6", "cuda:6"), lambda d: stats[d])  # type: ignore[arg-type]
    exported.refresh()
    exported.refresh()  # nothing new: nothing added
    assert _value("pdserve_gpu_alloc_retries_total", "cuda:6") == retries + 2
    assert _value("pdserve_gpu_memory_allocated_bytes", "cuda:6") == 100
    assert _value("pdserve_gpu_memory_reserved_bytes", "cuda:6") == 300
    stats[torch.device("cuda:6")].update(
        {"num_alloc_retries": 5, "num_ooms": 1, "allocated_bytes.all.current": 50}
    )
    exported.refresh()
    assert _value("pdserve_gpu_alloc_retries_total", "cuda:6") == retries + 5
    assert _value("pdserve_gpu_ooms_total", "cuda:6") == ooms + 1
    assert _value("pdserve_gpu_memory_allocated_bytes", "cuda:6") == 50


def test_a_worker_on_the_cpu_reads_no_gpu() -> None:
    def refuse(device: torch.device) -> dict[str, Any]:
        raise AssertionError(f"read {device}")

    TorchMetrics(_Pools("cpu", "cpu"), refuse).refresh()  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_on_a_gpu_shows_in_the_allocators_figures() -> None:
    pool = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    class _Engine:
        def kv_pools(self) -> list[torch.Tensor]:
            return [pool]

    TorchMetrics(_Engine()).refresh()  # type: ignore[arg-type]
    label = str(pool.device)
    assert (_value("pdserve_gpu_memory_allocated_bytes", label) or 0) >= 64 << 20
    reserved = _value("pdserve_gpu_memory_reserved_bytes", label) or 0
    assert reserved >= (_value("pdserve_gpu_memory_allocated_bytes", label) or 0)


def test_a_compilation_is_counted() -> None:
    exported = TorchMetrics(_Pools("cpu"))  # type: ignore[arg-type]
    exported.refresh()
    before = REGISTRY.get_sample_value("pdserve_torch_compiles_total") or 0.0
    frames = compiled_frames()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    double(torch.ones(3))
    assert compiled_frames() == frames + 1
    exported.refresh()
    exported.refresh()
    assert REGISTRY.get_sample_value("pdserve_torch_compiles_total") == before + 1
