"""Factories for scheduler unit tests: workers, snapshots, requests."""

from __future__ import annotations

from typing import Any

from services.scheduler.types import RequestFeatures
from shared.cluster import KvLayout, LoadSnapshot, RankLoad, Role, WorkerInfo, WorkerLoad

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
BF16 = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")


def worker(
    worker_id: str,
    role: Role,
    used: list[int] | None = None,
    *,
    model: str = "m",
    layout: KvLayout = LAYOUT,
    age_ms: int = 0,
    stale: bool = False,
    max_model_len: int = 2048,
) -> WorkerLoad:
    used = used or [0, 0]
    info = WorkerInfo(
        worker_id=worker_id,
        address=f"{worker_id}:1",
        role=role,
        model_id=model,
        dp_size=len(used),
        kv_layout=layout,
        capabilities=("generated_tokens",),
        max_model_len=max_model_len,
    )
    ranks = tuple(RankLoad(i, num_used_tokens=u) for i, u in enumerate(used))
    return WorkerLoad(info=info, ranks=ranks, age_ms=age_ms, stale=stale)


def snapshot(*workers: WorkerLoad) -> LoadSnapshot:
    return LoadSnapshot(workers=tuple(workers), version=1, timestamp_ms=0)


def request(
    request_id: str = "r", prompt_tokens: int = 100, hashes: tuple[int, ...] = (), **kw: Any
) -> RequestFeatures:
    return RequestFeatures(
        request_id=request_id, prompt_tokens=prompt_tokens, prefix_block_hashes=hashes, **kw
    )
