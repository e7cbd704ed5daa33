"""What torch itself reports that a worker's operators need, exported to Prometheus:

- for every GPU its KV pools live on, torch's caching allocator (`torch.cuda.memory_stats`):
  bytes allocated and reserved as gauges, its allocation retries and out-of-memory failures as
  counters. Why: a rank sizes its KV pool at start from the largest step it measured
  (engine/memory.py); a served step that needs more than what was left makes the allocator free
  its cache and retry, a device-wide synchronization that slows that step several times over
  and shows nowhere else. A worker without CUDA pools exports none of these;
- the frames torch.compile compiled in the process (the fused layer halves and FlexAttention on
  CUDA, compiled at start): one more while serving is a step stalled for seconds.

torch's figures are cumulative; they become counter increments, each counted once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.worker.engine.api import Engine
from shared import metrics


def compiled_frames() -> int:
    """Frames torch.compile compiled in this process so far (recompilations included)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo: nothing is ever compiled
        return 0
    return int(counters["frames"]["ok"])


# what is read of torch.cuda.memory_stats
_ALLOCATED = "allocated_bytes.all.current"
_RESERVED = "reserved_bytes.all.current"
_RETRIES = "num_alloc_retries"
_OOMS = "num_ooms"


class TorchMetrics:
    """Exports torch's figures: the allocator's of the engine's GPUs and the compiled frames
    (call `refresh` periodically). `memory_stats`: torch.cuda.memory_stats, or a stand-in in
    tests."""

    def __init__(
        self, engine: Engine, memory_stats: Callable[[torch.device], dict[str, Any]] | None = None
    ) -> None:
        self._engine = engine
        self._devices: list[torch.device] | None = None  # read at the first refresh
        self._memory_stats = memory_stats or torch.cuda.memory_stats
        # per device, (retries, ooms) already exported to Prometheus (torch counts since start)
        self._seen: dict[torch.device, tuple[int, int]] = {}
        self._frames_seen = 0

    def refresh(self) -> None:
        frames = compiled_frames()
        if frames > self._frames_seen:
            metrics.TORCH_COMPILES.inc(frames - self._frames_seen)
            self._frames_seen = frames
        if self._devices is None:
            pools = self._engine.kv_pools()
            self._devices = sorted({p.device for p in pools if p.device.type == "cuda"}, key=str)
        for device in self._devices:
            stats = self._memory_stats(device)
            label = str(device)
            metrics.GPU_MEMORY_ALLOCATED.labels(device=label).set(stats.get(_ALLOCATED, 0))
            metrics.GPU_MEMORY_RESERVED.labels(device=label).set(stats.get(_RESERVED, 0))
            retries, ooms = int(stats.get(_RETRIES, 0)), int(stats.get(_OOMS, 0))
            seen_retries, seen_ooms = self._seen.get(device, (0, 0))
            if retries > seen_retries:
                metrics.GPU_ALLOC_RETRIES.labels(device=label).inc(retries - seen_retries)
            if ooms > seen_ooms:
                metrics.GPU_OOMS.labels(device=label).inc(ooms - seen_ooms)
            self._seen[device] = (max(retries, seen_retries), max(ooms, seen_ooms))
