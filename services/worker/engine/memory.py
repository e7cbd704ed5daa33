"""How big a rank's KV pool is: `pool_blocks`. On CPU a share of free host memory; on a GPU
(issue 31, item 3) what --gpu-memory-utilization leaves, like vLLM's.

On a GPU: `measure_gpu` (what a rank measures at start) and `kv_pool_bytes` (the arithmetic): a worker
may use `utilization` of the GPU's total memory for everything it holds (weights, the largest
step's activations, the CUDA context and workspaces, its CUDA graphs, the KV pool); the pool gets
what is left, and never more than is free on the device now (another process's memory is not
ours to take). The activations are measured, not guessed: the engine runs the largest step its
settings allow (a prefill chunk of max_batch_tokens tokens) once before the pool exists and reads
torch's peak. A budget that cannot hold one sequence of max_model_len tokens is an error that
names every number, raised before any pool is allocated, so a start that cannot work ends with
one line and exit 1, never an out-of-memory traceback halfway through.

Several workers on one GPU (`pdserve up` on a one-GPU machine) split the utilization between
them (services/up.py); DP ranks of one process that share a GPU split their process's share.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine.api import EngineConfig, KvLayout, SamplingConfig
from services.worker.engine.backend import ModelBackend
from services.worker.engine.gpu_placement import ranks_on, worker_gpus
from shared.errors import ResourceExhausted

log = logging.getLogger(__name__)

# without an explicit kv_cache_tokens a CPU pool is capped here (bytes): host RAM is shared
CPU_POOL_CAP_BYTES = 1 << 30

# Held back from the pool for what torch's allocator does not see or cannot predict at start:
# the CUDA context of the process, cuBLAS and Triton workspaces, allocator fragmentation, and the
# CUDA graphs captured after the pool (one small activation set per batch size with attention in
# place). 1 GiB is a quarter of a percent of an H200's memory.
CUDA_RESERVE_BYTES = 1 << 30

_GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuBudget:
    """What one rank measured at start (bytes)."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device after the weights were loaded (all processes)
    weights_bytes: int  # this process's allocation after loading (weights, buffers)
    activation_bytes: int  # the largest step's peak above what was allocated before it


def kv_pool_bytes(
    budget: GpuBudget,
    utilization: float,
    ranks_on_device: int,
    bytes_per_token: int,
    min_tokens: int,
    reserve_bytes: int = CUDA_RESERVE_BYTES,
) -> int:
    """Bytes for one rank's KV pool. `utilization` of the device is this process's share; its
    ranks on this device share it (each rank's own weights and activations come off its share).
    Raises ResourceExhausted when fewer than `min_tokens` tokens of KV would fit."""
    if not 0.0 < utilization <= 1.0:
        raise ResourceExhausted(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    share = int(budget.total_bytes * utilization) // max(1, ranks_on_device)
    own = budget.weights_bytes + budget.activation_bytes + reserve_bytes
    # memory other processes (and this process's earlier ranks) hold is not ours: at most what
    # is free now
    free = budget.free_bytes - budget.activation_bytes - reserve_bytes
    pool = min(share - own, free)
    need = min_tokens * bytes_per_token
    if pool < need:
        raise ResourceExhausted(
            f"GPU memory: {utilization:g} of {budget.total_bytes / _GIB:.1f} GiB"
            + (f" over {ranks_on_device} ranks" if ranks_on_device > 1 else "")
            + f" is {share / _GIB:.1f} GiB per rank; the weights take {budget.weights_bytes / _GIB:.1f} GiB,"
            f" the largest step {budget.activation_bytes / _GIB:.1f} GiB, the reserve"
            f" {reserve_bytes / _GIB:.1f} GiB, {budget.free_bytes / _GIB:.1f} GiB are free on the device,"
            f" leaving {max(pool, 0) / _GIB:.2f} GiB for the KV cache; one sequence of {min_tokens} tokens"
            f" needs {need / _GIB:.2f} GiB: raise --gpu-memory-utilization, or lower --max-model-len"
            " or --max-batch-tokens"
        )
    return pool


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def pool_blocks(
    cfg: EngineConfig,
    max_model_len: int,
    layouts: Sequence[KvLayout],
    dtype: torch.dtype,
    device: torch.device,
    gpu: GpuBudget | None,
) -> int:
    """Blocks per rank: kv_cache_tokens when set; on CUDA what `gpu` (measured at start) leaves of
    gpu_memory_utilization; elsewhere kv_memory_fraction of free host memory, capped at 1 GiB
    (host RAM is shared with everything else). Never more than max_num_seqs full-length requests
    can use. `layouts`: the target's, and a draft model's whose pool follows the target's size
    (they share the memory token for token)."""
    if cfg.kv_cache_tokens > 0:
        return -(-cfg.kv_cache_tokens // cfg.block_size)
    per_token = sum(lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * dtype.itemsize for lay in layouts)
    if gpu is not None:
        gpus = worker_gpus(cfg.cuda_devices, torch.cuda.device_count())
        ranks_here = ranks_on(device.index or 0, cfg.dp_size, gpus)
        budget = kv_pool_bytes(
            gpu, cfg.gpu_memory_utilization, ranks_here, per_token, min_tokens=max_model_len
        )
    else:
        budget = int(available_host_bytes() * cfg.kv_memory_fraction)
        budget = min(budget // cfg.dp_size, CPU_POOL_CAP_BYTES)
    tokens = min(budget // per_token, cfg.max_num_seqs * max_model_len)
    return max(1, tokens // cfg.block_size)


def measure_gpu(
    model: Any,
    layout: KvLayout,
    device: torch.device,
    dtype: torch.dtype,
    allocated_before: int,
    prefill_tokens: int,
    cfg: EngineConfig,
    max_model_len: int,
    backend: ModelBackend,
) -> GpuBudget:
    """The rank's weights (what loading it allocated: `allocated_before` was read before), the
    device's free memory, and the peak activations of the largest step the settings allow: one
    prefill chunk of `prefill_tokens` tokens, run once through a runner with a pool just big
    enough, before the real pool exists."""
    from services.worker.engine.model_runner import ModelRunner, ScheduledSeq

    tokens = min(prefill_tokens, max(1, max_model_len - 1))
    blocks = -(-tokens // cfg.block_size)
    probe = ModelRunner(
        model,
        layout,
        blocks,
        device,
        dtype,
        backend=backend,
        max_model_len=max_model_len,
    )
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe.execute([ScheduledSeq([0] * tokens, 0, list(range(blocks)), True, greedy, None)])
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = GpuBudget(
        total_bytes=int(total),
        free_bytes=int(free),
        weights_bytes=torch.cuda.memory_allocated(device) - allocated_before,
        activation_bytes=int(activation),
    )
    log.info(
        "GPU memory at start: %.1f GiB total, %.1f GiB free, weights %.2f GiB, largest step "
        "(%d tokens) %.2f GiB",
        total / _GIB,
        free / _GIB,
        budget.weights_bytes / _GIB,
        tokens,
        activation / _GIB,
    )
    return budget
