"""shared.cluster_convert: every cluster type survives protobuf and back; every proto enum value
has a domain member; unknown values are read as None or refused, never guessed."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import cluster_convert as cc
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
)
from shared.errors import InvalidArgument
from shared.proto import common_pb2, load_monitor_pb2, scheduler_pb2, worker_pb2

BIG = 2**40  # beyond 32 bits: the uint64 fields must carry it

LAYOUTS = [
    KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32"),
    KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="bfloat16"),
    KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="bfloat16", weights="fp8"),
]
INFOS = [
    WorkerInfo("p-1", "10.0.0.1:50061", Role.PREFILL, "m", 2, LAYOUTS[0]),
    WorkerInfo(
        worker_id="d-2",
        address="[fd00::7]:50071",
        role=Role.DECODE,
        model_id="SmolLM2",
        dp_size=4,
        kv_layout=LAYOUTS[1],
        capabilities=("generated_tokens", "kv_block_skip"),
        proto_version="1.1",
        max_model_len=8192,
        device="cuda",
        lora_adapters=("sql-lora", "org/chat-lora"),
    ),
    WorkerInfo("u", "h:1", Role.UNIFIED, "", 1, LAYOUTS[0], device="cpu"),
]
LOADS = [
    RankLoad(0),
    RankLoad(
        3,
        num_used_tokens=BIG,
        num_running=7,
        num_waiting=2,
        kv_capacity_tokens=BIG + 1,
        prefix_cache_queries_tokens=BIG,
        prefix_cache_hits_tokens=12,
    ),
]


@pytest.mark.parametrize("role", list(Role))
def test_role_round_trip(role: Role) -> None:
    assert cc.role_from_pb(cc.role_to_pb(role)) is role


@pytest.mark.parametrize("reason", [*FinishReason, None])
def test_finish_reason_round_trip(reason: FinishReason | None) -> None:
    assert cc.finish_reason_from_pb(cc.finish_reason_to_pb(reason)) is reason


def test_no_finish_reason_is_unspecified_on_the_wire() -> None:
    assert cc.finish_reason_to_pb(None) == common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize("mode", list(ServingMode))
def test_serving_mode_round_trip(mode: ServingMode) -> None:
    assert cc.serving_mode_from_pb(cc.serving_mode_to_pb(mode)) is mode


@pytest.mark.parametrize("kind", list(DecodeFrameKind))
def test_decode_frame_kind_round_trip(kind: DecodeFrameKind) -> None:
    assert cc.decode_frame_kind_from_pb(cc.decode_frame_kind_to_pb(kind)) is kind


@pytest.mark.parametrize(
    ("pb_enum", "from_pb"),
    [
        (common_pb2.WorkerRole, cc.role_from_pb),
        (common_pb2.FinishReason, cc.finish_reason_from_pb),
        (scheduler_pb2.ServingMode, cc.serving_mode_from_pb),
        (worker_pb2.DecodeFrameKind, cc.decode_frame_kind_from_pb),
    ],
)
def test_every_proto_value_has_a_member_and_unknown_ones_read_as_none(
    pb_enum: Any, from_pb: Callable[[int], enum.Enum | None]
) -> None:
    for name, value in pb_enum.items():
        if name.endswith("_UNSPECIFIED"):
            assert from_pb(value) is None
        else:
            assert from_pb(value) is not None, name  # a value added to the proto needs a member
    assert from_pb(max(pb_enum.values()) + 1) is None  # from a newer peer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_layout_round_trip(layout: KvLayout) -> None:
    assert cc.kv_layout_from_pb(cc.kv_layout_to_pb(layout)) == layout


@pytest.mark.parametrize("info", INFOS)
def test_worker_info_round_trip(info: WorkerInfo) -> None:
    pb = cc.worker_info_to_pb(info)
    assert cc.worker_info_from_pb(pb) == info
    assert cc.worker_info_to_pb(cc.worker_info_from_pb(pb)) == pb  # and the wire form too


@pytest.mark.parametrize("role", [common_pb2.WORKER_ROLE_UNSPECIFIED, 7])
def test_worker_info_without_a_known_role_is_refused(role: int) -> None:
    pb = cc.worker_info_to_pb(INFOS[0])
    pb.role = role  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match="role must be PREFILL, DECODE or UNIFIED"):
        cc.worker_info_from_pb(pb)


@pytest.mark.parametrize("load", LOADS)
def test_rank_load_round_trip(load: RankLoad) -> None:
    pb = cc.rank_load_to_pb(load)
    assert cc.rank_load_from_pb(pb) == load
    assert pb.prefix_cache_hit_rate == pytest.approx(load.prefix_cache_hit_rate)  # derived, sent


def test_load_snapshot_round_trip() -> None:
    snapshot = LoadSnapshot(
        workers=(
            WorkerLoad(INFOS[0], (RankLoad(0, 5), RankLoad(1, num_waiting=3)), age_ms=BIG, stale=True),
            WorkerLoad(INFOS[2], (RankLoad(0, kv_capacity_tokens=4096),), age_ms=0, stale=False),
        ),
        version=BIG,
        timestamp_ms=1_700_000_000_000,
    )
    back, skipped = cc.snapshot_from_pb(cc.snapshot_to_pb(snapshot))
    assert back == snapshot and skipped == []


def test_snapshot_skips_unusable_workers_and_sums_ranks() -> None:
    def entry(worker_id: str, role: int) -> load_monitor_pb2.WorkerLoad:
        return load_monitor_pb2.WorkerLoad(
            info=common_pb2.WorkerInfo(
                worker_id=worker_id,
                address="h:1",
                role=role,  # type: ignore[arg-type]
                model_id="m",
                dp_size=2,
                kv_layout=common_pb2.KvLayout(block_size=16, dtype="float32"),
            ),
            ranks=[
                common_pb2.RankLoad(dp_rank=1, num_used_tokens=5),
                common_pb2.RankLoad(dp_rank=1, num_used_tokens=2),
                common_pb2.RankLoad(dp_rank=9, num_used_tokens=100),  # no such rank: dropped
            ],
        )

    pb = load_monitor_pb2.LoadSnapshot(
        workers=[entry("ok", common_pb2.WORKER_ROLE_DECODE), entry("odd", 7)], version=3
    )
    snapshot, skipped = cc.snapshot_from_pb(pb)
    assert [w.info.worker_id for w in snapshot.workers] == ["ok"] and skipped == ["odd"]
    assert [r.num_used_tokens for r in snapshot.workers[0].ranks] == [0, 7]  # summed per rank
    assert snapshot.version == 3


# --- property-based: any value the wire types can carry survives the round trip ------------------

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)

layouts = st.builds(
    KvLayout,
    num_layers=U32,
    num_kv_heads=U32,
    head_dim=U32,
    block_size=U32,
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    weights=st.sampled_from(["", "fp8"]),
)


def infos(dp_size: st.SearchStrategy[int] = U32) -> st.SearchStrategy[WorkerInfo]:
    return st.builds(
        WorkerInfo,
        worker_id=st.text(),
        address=st.text(),
        role=st.sampled_from(list(Role)),
        model_id=st.text(),
        dp_size=dp_size,
        kv_layout=layouts,
        capabilities=st.lists(st.text(), max_size=4).map(tuple),
        proto_version=st.text(max_size=8),
        max_model_len=U32,
        device=st.sampled_from(["", "cpu", "cuda"]),
    )


def rank_loads(dp_rank: st.SearchStrategy[int] = U32) -> st.SearchStrategy[RankLoad]:
    return st.builds(
        RankLoad,
        dp_rank=dp_rank,
        num_used_tokens=U64,
        num_running=U32,
        num_waiting=U32,
        kv_capacity_tokens=U64,
        prefix_cache_queries_tokens=U64,
        prefix_cache_hits_tokens=U64,
    )


@st.composite
def worker_loads(draw: st.DrawFn) -> WorkerLoad:
    dp_size = draw(st.integers(1, 4))
    ranks = tuple(draw(rank_loads(st.just(rank))) for rank in range(dp_size))  # normalized form
    return WorkerLoad(draw(infos(st.just(dp_size))), ranks, age_ms=draw(U64), stale=draw(st.booleans()))


@given(infos())
def test_any_worker_info_round_trips(info: WorkerInfo) -> None:
    assert cc.worker_info_from_pb(cc.worker_info_to_pb(info)) == info


@given(rank_loads())
def test_any_rank_load_round_trips(load: RankLoad) -> None:
    assert cc.rank_load_from_pb(cc.rank_load_to_pb(load)) == load


@given(st.lists(worker_loads(), max_size=3).map(tuple), U64, U64)
def test_any_snapshot_round_trips(workers: tuple[WorkerLoad, ...], version: int, timestamp_ms: int) -> None:
    snapshot = LoadSnapshot(workers, version, timestamp_ms)
    assert cc.snapshot_from_pb(cc.snapshot_to_pb(snapshot)) == (snapshot, [])


def test_a_layout_of_the_models_own_weights_leaves_weights_unset_as_an_older_worker_does() -> None:
    pb = cc.kv_layout_to_pb(LAYOUTS[0])
    assert not pb.HasField("weights")
    assert cc.kv_layout_from_pb(pb) == LAYOUTS[0]
    assert cc.kv_layout_to_pb(LAYOUTS[-1]).weights == "fp8"
