"""Protobuf <-> domain conversion for the scheduler (the only module that knows both)."""

from __future__ import annotations

from services.load_monitor import convert as load_convert
from services.load_monitor.types import LoadSnapshot
from services.scheduler.types import Decision, Mode, RequestFeatures, RouterState, Target
from shared.errors import InvalidArgument
from shared.proto import load_monitor_pb2, scheduler_pb2

_MODE_TO_PB = {
    Mode.DISAGGREGATED: scheduler_pb2.SERVING_MODE_DISAGGREGATED,
    Mode.AGGREGATED: scheduler_pb2.SERVING_MODE_AGGREGATED,
    Mode.LOCAL_PREFILL: scheduler_pb2.SERVING_MODE_LOCAL_PREFILL,
}


def features_from_pb(pb: scheduler_pb2.ScheduleRequest) -> RequestFeatures:
    if not pb.request_id:
        raise InvalidArgument("request_id is required")
    return RequestFeatures(
        request_id=pb.request_id,
        prompt_tokens=pb.prompt_tokens,
        model=pb.model,
        prefix_block_hashes=tuple(pb.prefix_block_hashes),
        max_tokens=pb.max_tokens,
        exclude_worker_ids=frozenset(pb.exclude_worker_ids),
    )


def _target_to_pb(t: Target) -> scheduler_pb2.WorkerTarget:
    return scheduler_pb2.WorkerTarget(
        worker_id=t.worker_id, address=t.address, dp_rank=t.dp_rank, capabilities=t.capabilities
    )


def decision_to_pb(d: Decision) -> scheduler_pb2.ScheduleResponse:
    pb = scheduler_pb2.ScheduleResponse(
        mode=_MODE_TO_PB[d.mode],
        decode=_target_to_pb(d.decode),
        model=d.model,
        max_model_len=d.max_model_len,
    )
    if d.prefill is not None:
        pb.prefill.CopyFrom(_target_to_pb(d.prefill))
    return pb


def state_to_pb(s: RouterState) -> scheduler_pb2.GetStateResponse:
    return scheduler_pb2.GetStateResponse(
        workers=[
            scheduler_pb2.SchedulerWorker(
                info=load_convert.worker_info_to_pb(w.info),
                ranks=[load_convert.rank_load_to_pb(r) for r in w.ranks],
                reserved_tokens=list(w.reserved_tokens),
            )
            for w in s.workers
        ],
        stale=s.stale,
        prefill_policy=s.prefill_policy,
        decode_policy=s.decode_policy,
        dp_rank_policy=s.dp_rank_policy,
    )


def snapshot_from_pb(pb: load_monitor_pb2.LoadSnapshot) -> tuple[LoadSnapshot, list[str]]:
    """The snapshot, and the ids of workers left out because their entry is unusable (e.g. a
    role this scheduler does not know, from a newer load-monitor): one bad entry must not stop
    routing to the others."""
    workers = []
    skipped = []
    for w in pb.workers:
        try:
            workers.append(load_convert.worker_load_from_pb(w))
        except InvalidArgument:
            skipped.append(w.info.worker_id)
    return LoadSnapshot(tuple(workers), pb.version, pb.timestamp_ms), skipped
