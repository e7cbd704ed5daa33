"""The KV pool's share of GPU memory (engine/memory.py): what utilization leaves after the
weights, the measured largest step and the reserve, never more than is free, split between DP
ranks on one device, and a clear error naming the numbers when one sequence cannot fit."""

from __future__ import annotations

import pytest

from services.worker.engine.memory import GpuBudget, kv_pool_bytes
from shared.errors import ResourceExhausted

GIB = 1 << 30
# an 8B model in bf16 on a 140 GiB GPU: 14.4 GiB of weights, a 2,048-token prefill's activations
H200 = GpuBudget(
    total_bytes=140 * GIB, free_bytes=125 * GIB, weights_bytes=int(14.4 * GIB), activation_bytes=GIB // 2
)
KV_PER_TOKEN = 128 * 1024  # Llama-3-8B: 32 layers x 8 heads x 128 x 2 x 2 B


def test_the_pool_gets_what_utilization_leaves() -> None:
    pool = kv_pool_bytes(H200, 0.9, 1, KV_PER_TOKEN, min_tokens=8192, reserve_bytes=GIB)
    assert pool == int(140 * GIB * 0.9) - int(14.4 * GIB) - GIB // 2 - GIB
    # two workers on the GPU (pdserve up gives each 0.45): each pool is far smaller, both fit
    half = kv_pool_bytes(H200, 0.45, 1, KV_PER_TOKEN, min_tokens=8192, reserve_bytes=GIB)
    assert half == int(140 * GIB * 0.45) - int(14.4 * GIB) - GIB // 2 - GIB
    assert 2 * (half + int(14.4 * GIB)) < 140 * GIB


def test_never_more_than_is_free_now() -> None:
    """Another process holds most of the device: the pool is what is free, not what the share
    would allow."""
    crowded = GpuBudget(140 * GIB, 30 * GIB, int(14.4 * GIB), GIB // 2)
    assert kv_pool_bytes(crowded, 0.9, 1, KV_PER_TOKEN, 8192, reserve_bytes=GIB) == 30 * GIB - GIB // 2 - GIB


def test_ranks_on_one_device_split_the_share() -> None:
    one = kv_pool_bytes(H200, 0.9, 1, KV_PER_TOKEN, 8192, reserve_bytes=GIB)
    two = kv_pool_bytes(H200, 0.9, 2, KV_PER_TOKEN, 8192, reserve_bytes=GIB)
    assert two == int(140 * GIB * 0.9) // 2 - int(14.4 * GIB) - GIB // 2 - GIB < one


def test_a_budget_without_room_for_one_sequence_says_every_number() -> None:
    with pytest.raises(ResourceExhausted) as err:
        kv_pool_bytes(H200, 0.11, 1, KV_PER_TOKEN, min_tokens=8192, reserve_bytes=GIB)
    text = str(err.value)
    for part in (
        "0.11 of 140.0 GiB",
        "weights take 14.4 GiB",
        "one sequence of 8192 tokens",
        "1.00 GiB",
        "--gpu-memory-utilization",
    ):
        assert part in text, text
    assert "\n" not in text
    # weights alone over the share: the pool would be negative, reported as 0
    with pytest.raises(ResourceExhausted, match=r"leaving 0\.00 GiB"):
        kv_pool_bytes(H200, 0.05, 1, KV_PER_TOKEN, min_tokens=1)
    with pytest.raises(ResourceExhausted, match=r"must be in \(0, 1\]"):
        kv_pool_bytes(H200, 1.5, 1, KV_PER_TOKEN, min_tokens=1)
