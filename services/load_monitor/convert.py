"""Protobuf <-> domain conversion for the load-monitor (the only module that knows both)."""

from __future__ import annotations

from services.load_monitor.monitor import LoadReport, Registration
from services.load_monitor.types import (
    KvLayout,
    LoadSnapshot,
    RankLoad,
    Role,
    WorkerInfo,
    WorkerLoad,
    sum_rank_loads,
)
from shared.errors import InvalidArgument
from shared.proto import common_pb2, load_monitor_pb2, worker_pb2

_ROLE_FROM_PB = {
    common_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
    common_pb2.WORKER_ROLE_DECODE: Role.DECODE,
    common_pb2.WORKER_ROLE_UNIFIED: Role.UNIFIED,
}
_ROLE_TO_PB = {role: pb for pb, role in _ROLE_FROM_PB.items()}


def worker_info_from_pb(pb: common_pb2.WorkerInfo) -> WorkerInfo:
    role = _ROLE_FROM_PB.get(pb.role)
    if role is None:
        raise InvalidArgument("worker role must be PREFILL, DECODE or UNIFIED")
    layout = pb.kv_layout
    return WorkerInfo(
        worker_id=pb.worker_id,
        address=pb.address,
        role=role,
        model_id=pb.model_id,
        dp_size=pb.dp_size,
        kv_layout=KvLayout(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            dtype=layout.dtype,
        ),
        capabilities=tuple(pb.capabilities),
        proto_version=pb.proto_version,
        max_model_len=pb.max_model_len,
        device=pb.device,
    )


def worker_info_to_pb(info: WorkerInfo) -> common_pb2.WorkerInfo:
    layout = info.kv_layout
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        role=_ROLE_TO_PB[info.role],
        model_id=info.model_id,
        dp_size=info.dp_size,
        kv_layout=common_pb2.KvLayout(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            dtype=layout.dtype,
        ),
        capabilities=list(info.capabilities),
        proto_version=info.proto_version,
        max_model_len=info.max_model_len,
        device=info.device,
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
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,
    )


def load_report_from_pb(pb: worker_pb2.GetLoadResponse) -> LoadReport:
    return LoadReport(worker_id=pb.worker_id, ranks=[rank_load_from_pb(r) for r in pb.ranks])


def registration_to_pb(reg: Registration) -> load_monitor_pb2.RegisterResponse:
    return load_monitor_pb2.RegisterResponse(
        worker_id=reg.worker_id,
        lease_ttl_ms=reg.lease_ttl_ms,
        heartbeat_interval_ms=reg.heartbeat_interval_ms,
    )


def worker_load_to_pb(load: WorkerLoad) -> load_monitor_pb2.WorkerLoad:
    return load_monitor_pb2.WorkerLoad(
        info=worker_info_to_pb(load.info),
        ranks=[rank_load_to_pb(r) for r in load.ranks],
        age_ms=load.age_ms,
        stale=load.stale,
    )


def snapshot_to_pb(snapshot: LoadSnapshot) -> load_monitor_pb2.LoadSnapshot:
    return load_monitor_pb2.LoadSnapshot(
        workers=[worker_load_to_pb(w) for w in snapshot.workers],
        version=snapshot.version,
        timestamp_ms=snapshot.timestamp_ms,
    )


def worker_load_from_pb(pb: load_monitor_pb2.WorkerLoad) -> WorkerLoad:
    info = worker_info_from_pb(pb.info)
    return WorkerLoad(
        info=info,
        ranks=sum_rank_loads((rank_load_from_pb(r) for r in pb.ranks), info.dp_size),
        age_ms=pb.age_ms,
        stale=pb.stale,
    )


def snapshot_from_pb(pb: load_monitor_pb2.LoadSnapshot) -> LoadSnapshot:
    """For watchers (the scheduler); ranks are normalized to one summed entry per rank."""
    return LoadSnapshot(
        workers=tuple(worker_load_from_pb(w) for w in pb.workers),
        version=pb.version,
        timestamp_ms=pb.timestamp_ms,
    )
