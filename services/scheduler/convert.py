"""Protobuf <-> domain conversion for the scheduler's own messages (the cluster types, load
snapshots included, convert in shared.cluster_convert)."""

from __future__ import annotations

from services.scheduler.types import Decision, RequestFeatures, RouterState, Target
from shared.cluster_convert import rank_load_to_pb, serving_mode_to_pb, worker_info_to_pb
from shared.errors import InvalidArgument
from shared.proto import scheduler_pb2

# No model accepts more tokens than max_model_len (a uint32), so a larger prompt is a bad call.
# Bounding it keeps reservation sums far from the uint64 range of the state the scheduler reports.
MAX_PROMPT_TOKENS = 2**32 - 1
UINT64_MAX = 2**64 - 1


def features_from_pb(pb: scheduler_pb2.ScheduleRequest) -> RequestFeatures:
    if not pb.request_id:
        raise InvalidArgument("request_id is required")
    if pb.prompt_tokens > MAX_PROMPT_TOKENS:
        raise InvalidArgument(
            f"prompt_tokens {pb.prompt_tokens} is larger than any model accepts (at most {MAX_PROMPT_TOKENS})"
        )
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
                reserved_tokens=[min(max(t, 0), UINT64_MAX) for t in w.reserved_tokens],
            )
            for w in s.workers
        ],
        stale=s.stale,
        prefill_policy=s.prefill_policy,
        decode_policy=s.decode_policy,
        dp_rank_policy=s.dp_rank_policy,
    )
