"""Protobuf <-> domain conversion for the scheduler's own messages (the cluster types, load
snapshots included, convert in shared.cluster_convert)."""

from __future__ import annotations

from services.scheduler.types import Decision, RequestFeatures, RouterState, Target
from shared.cluster_convert import rank_load_to_pb, serving_mode_to_pb, worker_info_to_pb
from shared.errors import InvalidArgument
from shared.proto import scheduler_pb2


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
        mode=serving_mode_to_pb(d.mode),
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
                info=worker_info_to_pb(w.info),
                ranks=[rank_load_to_pb(r) for r in w.ranks],
                reserved_tokens=list(w.reserved_tokens),
            )
            for w in s.workers
        ],
        stale=s.stale,
        prefill_policy=s.prefill_policy,
        decode_policy=s.decode_policy,
        dp_rank_policy=s.dp_rank_policy,
    )

