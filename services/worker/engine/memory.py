"""How much GPU memory the KV pool gets (issue 31, item 3), like vLLM's --gpu-memory-utilization.

Owns `GpuBudget` (what a rank measured at start) and `kv_pool_bytes` (the arithmetic): a worker
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

from dataclasses import dataclass

from shared.errors import ResourceExhausted

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
