"""The scheduler's conversion bounds what a caller may ask for and never overflows what it reports."""

from __future__ import annotations

import pytest

from services.scheduler.convert import MAX_PROMPT_TOKENS, features_from_pb, state_to_pb
from services.scheduler.types import RouterState, WorkerView
from shared.cluster import KvLayout, Role, WorkerInfo
from shared.errors import InvalidArgument
from shared.proto import scheduler_pb2


def test_prompt_tokens_beyond_any_model_are_invalid() -> None:
    ok = features_from_pb(scheduler_pb2.ScheduleRequest(request_id="r", prompt_tokens=MAX_PROMPT_TOKENS))
    assert ok.prompt_tokens == MAX_PROMPT_TOKENS
    with pytest.raises(InvalidArgument, match="prompt_tokens"):
        features_from_pb(scheduler_pb2.ScheduleRequest(request_id="r", prompt_tokens=2**63))


def test_state_saturates_reserved_tokens_at_uint64() -> None:
    info = WorkerInfo(
        worker_id="w",
        address="127.0.0.1:1",
        role=Role.DECODE,
        model_id="m",
        dp_size=1,
        kv_layout=KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32"),
    )
    view = WorkerView(info=info, ranks=(), reserved_tokens=(2**65, -3), stale=False)
    pb = state_to_pb(
        RouterState(workers=(view,), stale=False, prefill_policy="a", decode_policy="b", dp_rank_policy="c")
    )
    assert list(pb.workers[0].reserved_tokens) == [2**64 - 1, 0]
