"""Domain records of the scheduler: what a request brings and what a decision says (no grpc)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.cluster import RankLoad, ServingMode, WorkerInfo


@dataclass(frozen=True)
class RequestFeatures:
    request_id: str
    prompt_tokens: int  # tokens
    model: str = ""  # "" = any served model
    prefix_block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full KV blocks
    max_tokens: int = 0
    exclude_worker_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Target:
    worker_id: str
    address: str
    dp_rank: int
    capabilities: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    mode: ServingMode
    prefill: Target | None  # DISAGGREGATED only
    decode: Target  # every mode; it also prefills in AGGREGATED and LOCAL_PREFILL
    model: str
    max_model_len: int  # tokens; 0 = unknown


@dataclass(frozen=True)
class WorkerView:
    """One routable worker as GetState shows it."""

    info: WorkerInfo
    ranks: tuple[RankLoad, ...]  # as last reported
    reserved_tokens: tuple[int, ...]  # per rank, since the last report
    stale: bool


@dataclass(frozen=True)
class RouterState:
    workers: tuple[WorkerView, ...]
    stale: bool  # the load-monitor stream is down; routing uses the last snapshot
    prefill_policy: str
    decode_policy: str
    dp_rank_policy: str
