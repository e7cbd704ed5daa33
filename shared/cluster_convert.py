"""Protobuf <-> `shared.cluster` conversion: the only place the cluster types meet generated stubs.

Enum values a peer sends that this version does not know read as None (the caller decides what an
unknown value means); a worker entry with an unknown role is refused with InvalidArgument.
"""

from __future__ import annotations

from shared.cluster import (
    DecodeFrameKind,
    FinishReason,
    KvLayout,
    LoadSnapshot,
    RankLoad,
    Role,
    ServingMode,
    WorkerInfo,
    WorkerLoad,
    sum_rank_loads,
)
from shared.errors import InvalidArgument
from shared.proto import common_pb2, load_monitor_pb2, scheduler_pb2, worker_pb2

_ROLE_FROM_PB = {
    common_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
    common_pb2.WORKER_ROLE_DECODE: Role.DECODE,
    common_pb2.WORKER_ROLE_UNIFIED: Role.UNIFIED,
}
_ROLE_TO_PB = {role: pb for pb, role in _ROLE_FROM_PB.items()}

_FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_FINISH_TO_PB = {reason: pb for pb, reason in _FINISH_FROM_PB.items()}

_MODE_FROM_PB = {
    scheduler_pb2.SERVING_MODE_DISAGGREGATED: ServingMode.DISAGGREGATED,
    scheduler_pb2.SERVING_MODE_AGGREGATED: ServingMode.AGGREGATED,
    scheduler_pb2.SERVING_MODE_LOCAL_PREFILL: ServingMode.LOCAL_PREFILL,
}
_MODE_TO_PB = {mode: pb for pb, mode in _MODE_FROM_PB.items()}

_DECODE_KIND_FROM_PB = {
    worker_pb2.DECODE_FRAME_KIND_ADMITTED: DecodeFrameKind.ADMITTED,
    worker_pb2.DECODE_FRAME_KIND_TOKENS: DecodeFrameKind.TOKENS,
    worker_pb2.DECODE_FRAME_KIND_FINAL: DecodeFrameKind.FINAL,
}
_DECODE_KIND_TO_PB = {kind: pb for pb, kind in _DECODE_KIND_FROM_PB.items()}


# --- enums ---
def role_to_pb(role: Role) -> common_pb2.WorkerRole:
    return _ROLE_TO_PB[role]


def role_from_pb(value: int) -> Role | None:
    """None for UNSPECIFIED or a role this version does not know."""
    return _ROLE_FROM_PB.get(value)  # type: ignore[call-overload]


def finish_reason_to_pb(reason: FinishReason | None) -> common_pb2.FinishReason:
    """None (not finished) -> FINISH_REASON_UNSPECIFIED."""
    return _FINISH_TO_PB[reason] if reason is not None else common_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """None for UNSPECIFIED (not finished) or a reason this version does not know."""
    return _FINISH_FROM_PB.get(value)  # type: ignore[call-overload]


def serving_mode_to_pb(mode: ServingMode) -> scheduler_pb2.ServingMode:
    return _MODE_TO_PB[mode]


def serving_mode_from_pb(value: int) -> ServingMode | None:
    """None for UNSPECIFIED or a mode this version does not know."""
    return _MODE_FROM_PB.get(value)  # type: ignore[call-overload]


def decode_frame_kind_to_pb(kind: DecodeFrameKind) -> worker_pb2.DecodeFrameKind:
    return _DECODE_KIND_TO_PB[kind]


def decode_frame_kind_from_pb(value: int) -> DecodeFrameKind | None:
    """None for UNSPECIFIED or a kind this version does not know."""
    return _DECODE_KIND_FROM_PB.get(value)  # type: ignore[call-overload]


# --- records ---
def kv_layout_to_pb(layout: KvLayout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        weights=layout.weights or None,  # unset for the model's own: what an older peer sends
    )


def kv_layout_from_pb(pb: common_pb2.KvLayout) -> KvLayout:
    return KvLayout(
        num_layers=pb.num_layers,
        num_kv_heads=pb.num_kv_heads,
        head_dim=pb.head_dim,
        block_size=pb.block_size,
        dtype=pb.dtype,
        weights=pb.weights,
    )


def worker_info_to_pb(info: WorkerInfo) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        role=role_to_pb(info.role),
        model_id=info.model_id,
        dp_size=info.dp_size,
        kv_layout=kv_layout_to_pb(info.kv_layout),
        capabilities=list(info.capabilities),
        proto_version=info.proto_version,
        max_model_len=info.max_model_len,
        device=info.device,
        lora_adapters=list(info.lora_adapters),
    )


def worker_info_from_pb(pb: common_pb2.WorkerInfo) -> WorkerInfo:
    """Raises InvalidArgument when the role is missing or unknown to this version."""
    role = role_from_pb(pb.role)
    if role is None:
        raise InvalidArgument("worker role must be PREFILL, DECODE or UNIFIED")
    return WorkerInfo(
        worker_id=pb.worker_id,
        address=pb.address,
        role=role,
        model_id=pb.model_id,
        dp_size=pb.dp_size,
        kv_layout=kv_layout_from_pb(pb.kv_layout),
        capabilities=tuple(pb.capabilities),
        proto_version=pb.proto_version,
        max_model_len=pb.max_model_len,
        device=pb.device,
        lora_adapters=tuple(pb.lora_adapters),  # empty from a worker older than 1.13
    )


def rank_load_to_pb(load: RankLoad) -> common_pb2.RankLoad:
    return common_pb2.RankLoad(
        dp_rank=load.dp_rank,
        num_used_tokens=load.num_used_tokens,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_capacity_tokens=load.kv_capacity_tokens,
        prefix_cache_queries_tokens=load.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=load.prefix_cache_hits_tokens,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,  # derived; not read back
        spec_draft_tokens=load.spec_draft_tokens,
        spec_accepted_tokens=load.spec_accepted_tokens,
    )


def rank_load_from_pb(pb: common_pb2.RankLoad) -> RankLoad:
    return RankLoad(
        dp_rank=pb.dp_rank,
        num_used_tokens=pb.num_used_tokens,
        num_running=pb.num_running,
        num_waiting=pb.num_waiting,
        kv_capacity_tokens=pb.kv_capacity_tokens,
        prefix_cache_queries_tokens=pb.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=pb.prefix_cache_hits_tokens,
        # unset by workers older than 1.2: 0 (nothing proposed)
        spec_draft_tokens=pb.spec_draft_tokens,
        spec_accepted_tokens=pb.spec_accepted_tokens,
    )


def worker_load_to_pb(load: WorkerLoad) -> load_monitor_pb2.WorkerLoad:
    return load_monitor_pb2.WorkerLoad(
        info=worker_info_to_pb(load.info),
        ranks=[rank_load_to_pb(r) for r in load.ranks],
        age_ms=load.age_ms,
        stale=load.stale,
    )


def worker_load_from_pb(pb: load_monitor_pb2.WorkerLoad) -> WorkerLoad:
    """Ranks are normalized to one summed entry per rank 0..dp_size-1 (sum_rank_loads)."""
    info = worker_info_from_pb(pb.info)
    return WorkerLoad(
        info=info,
        ranks=sum_rank_loads((rank_load_from_pb(r) for r in pb.ranks), info.dp_size),
        age_ms=pb.age_ms,
        stale=pb.stale,
    )


def snapshot_to_pb(snapshot: LoadSnapshot) -> load_monitor_pb2.LoadSnapshot:
    return load_monitor_pb2.LoadSnapshot(
        workers=[worker_load_to_pb(w) for w in snapshot.workers],
        version=snapshot.version,
        timestamp_ms=snapshot.timestamp_ms,
    )


def snapshot_from_pb(pb: load_monitor_pb2.LoadSnapshot) -> tuple[LoadSnapshot, list[str]]:
    """The snapshot, and the ids of workers left out because their entry is unusable (e.g. a
    role this version does not know, from a newer load-monitor): one bad entry must not stop
    routing to the others."""
    workers = []
    skipped = []
    for w in pb.workers:
        try:
            workers.append(worker_load_from_pb(w))
        except InvalidArgument:
            skipped.append(w.info.worker_id)
    return LoadSnapshot(tuple(workers), pb.version, pb.timestamp_ms), skipped
